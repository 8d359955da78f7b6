"""The server with continuous batching (``Model(parallel=N)``, ``serve --parallel N``):
concurrent streamed requests (official openai client) give the text each gets alone,
greedy and seeded; the queue limit answers 503 with ``Retry-After``; the default
``--parallel`` comes from the memory plan."""
from __future__ import annotations

import threading

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from edgeinfer.server import RETRY_AFTER_S, create_app  # noqa: E402
from test_server import ServerThread, wait_for  # noqa: E402

NAME = "stories"


@pytest.fixture(scope="module")
def model(stories_dir, tmp_path_factory):
    from edgeinfer import api
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    out = tmp_path_factory.mktemp("eif") / "stories.eif"  # every linear quantized
    convert(str(stories_dir), str(out), method="rtn", group_size=32, progress=False)
    return api.Model(read_model(str(out)), backend="cpu", n_ctx=512, threads=2, parallel=3)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(create_app(model, NAME, queue_limit=1)) as s:
        yield s


REQS = [dict(prompt="Once upon a time", max_tokens=40, temperature=0),
        dict(prompt="The little dog ran to the park and saw a big red ball. He", max_tokens=30,
             temperature=0.9, seed=7),
        dict(prompt="Lily", max_tokens=35, temperature=0.8, top_p=0.9, seed=11)]


def _complete(client, req):
    parts = []
    for ch in client.completions.create(model=NAME, stream=True, **req):
        parts.append(ch.choices[0].text or "")
    return "".join(parts)


def test_concurrent_streams_equal_alone(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    alone = [_complete(client, r) for r in REQS]
    assert all(len(t) > 20 for t in alone)
    before = model.pool.scheduler.batched_steps
    out: list = [None] * len(REQS)
    ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, _complete(client, REQS[i])))
          for i in range(len(REQS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out == alone
    assert model.pool.scheduler.batched_steps > before  # they really ran together
    # the seeded request again, after all that: the same text (the seed=7 report)
    assert _complete(client, REQS[1]) == alone[1]


def test_queue_limit_503_with_retry_after(server, model):
    from edgeinfer.batching import held_slot

    app = server.app
    body = dict(model=NAME, prompt="Once", max_tokens=3, temperature=0)
    results: list = []

    def post():
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))

    with held_slot(model.pool, 0), held_slot(model.pool, 1), held_slot(model.pool, 2):
        # 3 workers start (and wait for a slot of the model), the 4th waits in the queue
        ts = [threading.Thread(target=post) for _ in range(4)]
        for t in ts:
            t.start()
        assert wait_for(lambda: app.state.counters.queued == 1 and model.pool.waiting == 3)
        busy = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert busy.status_code == 503
        assert busy.headers["Retry-After"] == str(RETRY_AFTER_S)
        err = busy.json()["error"]
        assert err["code"] == "server_busy" and "queue limit 1" in err["message"]
    for t in ts:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 4  # the queued ones were served
    ok = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert ok.status_code == 200  # free again


def test_default_parallel_from_the_memory_plan(stories_dir):
    from edgeinfer.memory import default_parallel, parallel_sequences, plan_memory
    from edgeinfer.readers import read_model

    cfg = read_model(str(stories_dir)).config
    plan = plan_memory(cfg, 10 << 20, 400, "int8", 512)
    per_seq = plan.kv_bytes_per_token * 2048
    assert parallel_sequences(plan, 2048) == (plan.budget_bytes - plan.weights_bytes
                                              - plan.scratch_bytes) // per_seq
    assert default_parallel(cfg, 10 << 20, "int8", 512, 2048, 400) == 4  # capped
    # a budget with room for two sequences of the context: 2
    tight = (10 << 20) + plan.scratch_bytes + 2 * per_seq + per_seq // 2
    assert default_parallel(cfg, 10 << 20, "int8", 512, 2048, tight / 2**20) == 2
    two = plan_memory(cfg, 10 << 20, tight / 2**20, "int8", 512, parallel=2)
    assert two.parallel == 2 and two.max_context == 2048 and two.kv_bytes >= 2 * per_seq
    three = plan_memory(cfg, 10 << 20, tight / 2**20, "int8", 512, parallel=3)
    assert three.max_context < 2048  # three do not fit at 2048: shorter contexts

"""examples/desktop_chat.py driven headless (Qt's offscreen platform): load with the
progress bar, type, send, see streamed text, press Stop mid-answer, send again; a
screenshot of the window is a real PNG of its size."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6", reason="pip install -e '.[test]' (PySide6-Essentials)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "desktop_chat.py"


@pytest.fixture(scope="module")
def app():
    import os

    if os.environ.get("QT_QPA_PLATFORM") is None:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # (the test's process, not the runtime)
    from PySide6.QtWidgets import QApplication

    return QApplication.instance() or QApplication([])


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("desktop_chat", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wait(app, pred, timeout=120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        app.processEvents()
        time.sleep(0.005)
    app.processEvents()
    return True


def test_load_type_send_stream_stop_send_again(app, example, stories_dir, tmp_path):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    win = example.ChatWindow(max_tokens=2000)
    win.show()
    assert not win.send_button.isEnabled()  # nothing to send to while loading
    win.load_model(str(stories_dir), backend="reference", n_ctx=512)
    assert wait(app, lambda: win.model is not None), win.stats.text()
    assert win.progress.value() == 100 and win.send_button.isEnabled()
    assert "ready" in win.stats.text() and "MiB" in win.stats.text()

    # type and send; stop once text has streamed
    QTest.keyClicks(win.input, "Once upon a time")
    assert win.input.text() == "Once upon a time"
    QTest.mouseClick(win.send_button, Qt.LeftButton)
    assert win.answering and win.stop_button.isEnabled() and not win.send_button.isEnabled()
    assert wait(app, lambda: len("".join(win._reply)) >= 20 or not win.answering)
    assert win.answering, "the answer finished before Stop could be pressed"
    QTest.mouseClick(win.stop_button, Qt.LeftButton)
    assert wait(app, lambda: not win.answering, 10)
    final = win.last_final
    assert final.finish_reason == "cancelled"
    assert 0 < final.stats.generated_tokens < 500
    streamed = "".join(win._reply)
    assert streamed and streamed in win.transcript.toPlainText()
    assert "[stopped]" in win.transcript.toPlainText()
    assert "tok/s" in win.stats.text()
    assert win.messages[-1] == {"role": "assistant", "content": streamed}

    # send again: a second answer streams and ends by itself
    win.max_tokens = 24
    QTest.keyClicks(win.input, "The cat")
    QTest.keyClick(win.input, Qt.Key_Return)
    assert wait(app, lambda: not win.answering)
    assert win.last_final.finish_reason in ("stop", "length")
    assert win.last_final.stats.generated_tokens <= 24
    assert [m["role"] for m in win.messages] == ["user", "assistant", "user", "assistant"]
    assert win.messages[-1]["content"] and win.messages[-1]["content"] in \
        win.transcript.toPlainText()

    shot = tmp_path / "window.png"
    assert win.grab().save(str(shot))
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert (w, h) == (win.width(), win.height())
    win.close()


def test_a_bad_model_path_is_shown_not_raised(app, example, tmp_path):
    win = example.ChatWindow()
    win.load_model(str(tmp_path / "missing.gguf"))
    assert wait(app, lambda: "cannot load" in win.stats.text(), 30)
    assert win.model is None and not win.send_button.isEnabled()
    win.close()

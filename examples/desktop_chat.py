"""A small desktop chat on edgeinfer: a Qt (PySide6) window that loads a model with a
progress bar, streams the answer, stops it on demand and shows speed and memory.

    pip install -e . PySide6-Essentials
    python examples/desktop_chat.py                       # SmolLM2-135M-Instruct
    python examples/desktop_chat.py -m qwen2.5-coder-0.5b-instruct

What it shows of the API: ``edgeinfer.load(..., warm=True, notify=...)`` on a worker
thread (download, kernel compilation and, for NAME:int4, its first conversion happen
before the first question, and the status lines drive the progress bar); ``Model.chat_stream`` on a
worker thread with a ``threading.Event`` as the Stop button (the stream ends within one
token, with stats); the final event's stats for tok/s. Worker threads talk to the window
only through Qt signals (delivered on the GUI thread).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

#: progress bar value per loading stage (the status lines of ``edgeinfer.load``)
STAGES = (("fetching", 10), ("converting", 30), ("converted", 50), ("compiling", 60),
          ("prefill", 70), ("decode", 80), ("sampling", 90))


def rss_mib() -> float:
    """This process's resident memory now, MiB (Linux ``/proc``; else the peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    from edgeinfer.engine import peak_rss_mb

    return peak_rss_mb()


class Bridge(QObject):
    """Signals from the worker threads to the window. They carry only strings and ints
    (the loaded model and the final event wait in ``result`` for the slot to take)."""

    status = Signal(str, int)       # loading: message, progress 0-100
    loaded = Signal()               # result: the Model
    failed = Signal(str)            # loading or generation error
    delta = Signal(str, int)        # streamed text, tokens generated so far
    finished = Signal()             # result: the final GenerationEvent (or None)

    def __init__(self):
        super().__init__()
        self.result = None


class ChatWindow(QWidget):
    """The chat window. ``load_model`` starts loading; the Send button (or Enter) sends.

    Attributes:
        model: the loaded :class:`edgeinfer.api.Model` (None while loading).
        messages: the conversation (OpenAI-style dicts).
        last_final: the final event of the last answer (finish reason, stats).
    """

    def __init__(self, max_tokens: int = 512):
        super().__init__()
        self.setWindowTitle("edgeinfer chat")
        self.resize(640, 480)
        self.model = None
        self.messages: list[dict] = []
        self.max_tokens = max_tokens
        self.last_final = None
        self._cancel: threading.Event | None = None
        self._reply: list[str] = []
        self._t0 = 0.0
        self._t_first = None
        self.bridge = Bridge()
        self.bridge.status.connect(self._on_status)
        self.bridge.loaded.connect(self._on_loaded)
        self.bridge.failed.connect(self._on_failed)
        self.bridge.delta.connect(self._on_delta)
        self.bridge.finished.connect(self._on_finished)

        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.transcript = QTextEdit()
        self.transcript.setReadOnly(True)
        self.input = QLineEdit()
        self.input.setPlaceholderText("Type a message and press Enter")
        self.input.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stats = QLabel("loading...")
        self.stats.setTextInteractionFlags(Qt.TextSelectableByMouse)

        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.progress)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(row)
        layout.addWidget(self.stats)
        self._set_busy(loading=True)

    # ---- loading ------------------------------------------------------------------------
    def load_model(self, name_or_path: str, **load_kw) -> None:
        """Load on a worker thread; the progress bar follows ``edgeinfer.load``'s status
        lines; Send is enabled once the model is warm."""
        def work() -> None:
            import edgeinfer
            try:
                from edgeinfer.quant.convert import convert
                model = edgeinfer.load(name_or_path, converter=convert, warm=True,
                                       notify=self._notify, **load_kw)
            except Exception as e:  # noqa: BLE001  shown in the window
                self.bridge.failed.emit(f"cannot load {name_or_path}: {e}")
                return
            self.bridge.result = model
            self.bridge.loaded.emit()

        self.bridge.status.emit(f"loading {name_or_path}...", 5)
        threading.Thread(target=work, name="load-model", daemon=True).start()

    def _notify(self, message: str) -> None:  # worker thread
        value = next((v for key, v in STAGES if key in message), -1)
        self.bridge.status.emit(message, value)

    def _on_status(self, message: str, value: int) -> None:
        if value >= 0:
            self.progress.setValue(max(self.progress.value(), value))
        self.stats.setText(message)

    def _on_loaded(self) -> None:
        model, self.bridge.result = self.bridge.result, None
        self.model = model
        self.progress.setValue(100)
        self.stats.setText(f"ready: {model.backend.name} backend, context {model.n_ctx} "
                           f"tokens, memory {rss_mib():.0f} MiB")
        self._set_busy(False)
        self.input.setFocus()

    def _on_failed(self, message: str) -> None:
        self.stats.setText(message)
        self.transcript.append(f"<i>{message}</i>")
        self._set_busy(self.model is None)

    # ---- chatting -----------------------------------------------------------------------
    def _set_busy(self, answering: bool = False, loading: bool = False) -> None:
        self.send_button.setEnabled(not (answering or loading))
        self.input.setEnabled(not loading)
        self.stop_button.setEnabled(answering)

    @property
    def answering(self) -> bool:
        return self._cancel is not None

    def send(self) -> None:
        """Send the input line as a user message and stream the reply."""
        text = self.input.text().strip()
        if not text or self.model is None or self.answering:
            return
        self.input.clear()
        self.messages.append({"role": "user", "content": text})
        self.transcript.append(f"<b>You:</b> {_html(text)}")
        self.transcript.append("<b>Assistant:</b> ")
        self._reply, self._t_first = [], None
        self._cancel = threading.Event()
        self._t0 = time.perf_counter()
        self._set_busy(answering=True)
        cancel, convo = self._cancel, list(self.messages)

        def work() -> None:
            final, n = None, 0
            try:
                for ev in self.model.chat_stream(convo, max_tokens=self.max_tokens,
                                                 cancel=cancel,
                                                 **self.model.sampling_defaults()):
                    n += ev.token is not None
                    if ev.text:
                        self.bridge.delta.emit(ev.text, n)
                    if ev.finish_reason is not None:
                        final = ev
            except Exception as e:  # noqa: BLE001  shown in the window
                self.bridge.failed.emit(f"error: {e}")
            self.bridge.result = final
            self.bridge.finished.emit()

        threading.Thread(target=work, name="chat-answer", daemon=True).start()

    def stop(self) -> None:
        """The Stop button: cancel the answer being streamed (ends within one token)."""
        if self._cancel is not None:
            self._cancel.set()

    def _on_delta(self, text: str, tokens: int) -> None:
        self._reply.append(text)
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.End)
        cursor.insertText(text)
        self.transcript.setTextCursor(cursor)
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = (now, tokens)
        t1, n1 = self._t_first
        rate = f"{(tokens - n1) / (now - t1):.1f} tok/s" if tokens > n1 else "first token"
        self.stats.setText(f"answering... {tokens} tokens, {rate}, memory {rss_mib():.0f} MiB")

    def _on_finished(self) -> None:
        final, self.bridge.result = self.bridge.result, None
        self.last_final = final
        reply = "".join(self._reply)
        self.messages.append({"role": "assistant", "content": reply})
        if final is not None:
            s = final.stats
            note = " [stopped]" if final.finish_reason == "cancelled" else ""
            if note:
                self.transcript.insertPlainText(note)
            self.stats.setText(f"{s.generated_tokens} tokens, {s.decode_tok_s:.1f} tok/s, "
                               f"TTFT {s.ttft_s * 1000:.0f} ms, memory {rss_mib():.0f} MiB "
                               f"(peak {s.peak_rss_mb:.0f}); {final.finish_reason}")
        self._cancel = None
        self._set_busy(False)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A desktop chat window on edgeinfer.")
    ap.add_argument("--model", "-m", default="smollm2-135m-instruct",
                    help="catalog name or path (default smollm2-135m-instruct)")
    ap.add_argument("--backend", default=None, help="cpu (default), reference or opencl")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    win = ChatWindow(max_tokens=args.max_tokens)
    win.show()
    win.load_model(args.model, **({"backend": args.backend} if args.backend else {}))
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())

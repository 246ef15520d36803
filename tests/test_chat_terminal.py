"""`specq chat` in a real terminal (pexpect): streamed answer with the panel, Ctrl-C mid-answer, /quit."""

from __future__ import annotations

import json

import pexpect

from cli_bin import SPECQ
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings



def test_interactive_stream_interrupt_then_correct_answer_and_quit(tiny_target, tiny_close, tmp_path):
    save = tmp_path / "chat.json"
    child = pexpect.spawn(SPECQ, ["chat", "--target", str(tiny_target), "--draft", str(tiny_close), "--ctx", "4096",
                                  "--threads", "1", "--n-predict", "4000", "--draft-max", "4"],
                          encoding="utf-8", timeout=60, dimensions=(40, 100))
    try:
        child.expect("Ctrl-D to leave")
        child.sendline("def fibonacci(n):")
        child.expect(r"tokens [1-9]\d*")  # the panel, updated while tokens stream
        child.expect("verify/draft")
        child.sendintr()
        child.expect(r"interrupted; both caches are consistent")
        child.sendline("/n 24")
        child.expect("n-predict 24")
        child.sendline("The quick brown fox")
        child.expect(r"done \(n-predict\)")
        child.sendline(f"/save {save}")
        child.expect("saved to")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    doc = json.loads(save.read_text())
    t1, t2 = doc["turns"]
    assert t1["stop_reason"] == "interrupted" and 0 < t1["n_generated"] < 4000
    assert t2["stop_reason"] == "n_predict" and t2["n_generated"] == 24
    assert t2["n_reused"] > 0  # the interrupted answer stayed in the caches
    # The answer after Ctrl-C is what the target alone gives for the same history.
    hist = doc["history"]
    settings = GenerationSettings(n_predict=24)
    with Engine(tiny_target, None, ctx=4096, threads=1) as alone:
        ref = alone.session().generate(hist[:len(hist) - 24], settings, speculative=False).run()
    assert t2["tokens"] == ref.tokens


def test_ctrl_d_exits_0(tiny_target, tiny_close):
    child = pexpect.spawn(SPECQ, ["chat", "--target", str(tiny_target), "--draft", str(tiny_close), "--ctx", "256",
                                  "--threads", "1", "--no-color"], encoding="utf-8", timeout=30)
    try:
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

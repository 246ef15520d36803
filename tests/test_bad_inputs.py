"""Bad inputs, as a careless or hostile user gives them (issue #12): one row per input.

Each row is a command line (with {placeholders} for the bad files built below), the exit code, a phrase
that the one `specq: error:` line must hold (`specq: warning:` for runs that go on), and files that must not
exist afterwards. Every command runs as a subprocess of the installed CLI: several of these inputs
aborted the whole interpreter inside llama.cpp before specq checked them. A new bad input is one row.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cli_bin import SPECQ
from hfmodels import HFSpec, read_safetensors, write_checkpoint, write_safetensors
from tinymodels import TinySpec, vocab, write_tiny_gguf


@dataclass(frozen=True)
class Row:
    args: tuple[str, ...]
    code: int
    phrase: str  # in the one `specq: error:` line (or the `specq: warning:` line when code is 0)
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards
    stdin: str | None = None  # chat: piped turns
    forbid: str | None = None  # a phrase the line must not hold (a misleading fix)


BENCH = ("bench", "--n-predict", "4", "--threads", "1")
CHAT = ("chat", "--n-predict", "4", "--threads", "1")
TUNE = ("tune", "--n-predict", "4", "--threads", "1")

ROWS: dict[str, Row] = {
    # -- GGUF files llama.cpp would abort on or refuse: named before llama.cpp loads them --------
    "duplicate-token-bench": Row((*BENCH, "--target", "{dup}"), 1, "duplicate token text ({dup}: tokens 40 and 41"),
    "duplicate-token-chat": Row((*CHAT, "--target", "{dup}"), 1, "duplicate token text", stdin="hi\n"),
    "duplicate-token-tune": Row((*TUNE, "--target", "{target}", "--draft", "{dup}"), 1, "duplicate token text"),
    "duplicate-token-draft": Row((*BENCH, "--target", "{target}", "--draft", "{dup}"), 1, "duplicate token text"),
    "embedding-rows": Row((*BENCH, "--target", "{short_embd}"), 1, "token_embd.weight has 300 rows but the vocabulary has"),
    "output-rows": Row((*BENCH, "--target", "{short_output}"), 1, "output.weight has 300 rows"),
    "missing-tensor": Row((*BENCH, "--target", "{missing}"), 1, "tensor blk.1.ffn_up.weight is missing"),
    "wrong-shape": Row((*BENCH, "--target", "{transposed}"), 1, "tensor blk.0.ffn_down.weight has shape [64, 128]"),
    "add-bos-without-bos": Row((*BENCH, "--target", "{no_bos}"), 1, "asks for a BOS token but has none"),
    "truncated": Row((*BENCH, "--target", "{truncated}"), 1, "model file is truncated ({truncated}: tensor"),
    "plan-truncated": Row(("plan", "--target", "{truncated}", "--vram", "4GiB"), 1, "model file is truncated"),
    "plan-duplicate-token": Row(("plan", "--target", "{dup}", "--vram", "4GiB"), 1, "duplicate token text"),
    # -- values ---------------------------------------------------------------------------------
    "temp-nan": Row((*BENCH, "--target", "{target}", "--temp", "nan"), 2, "--temp must be a finite number (nan)"),
    "temp-inf": Row((*BENCH, "--target", "{target}", "--temp", "inf"), 2, "--temp must be a finite number (inf)"),
    "chat-temp-inf": Row((*CHAT, "--target", "{target}", "--temp", "inf"), 2, "--temp must be a finite number"),
    "tune-temp-nan": Row((*TUNE, "--target", "{target}", "--draft", "{target}", "--temp", "nan"), 2, "finite"),
    "p-min-nan": Row((*BENCH, "--target", "{target}", "--p-min", "nan"), 2, "--p-min must be a finite number"),
    "flash-attn-bogus": Row((*BENCH, "--target", "{target}", "--flash-attn", "sometimes"), 2,
                            "--flash-attn must be auto, on or off (sometimes)"),
    "ctx-draft-bogus": Row((*BENCH, "--target", "{target}", "--ctx-draft", "half"), 2,
                           "--ctx-draft must be a number or auto (half)"),
    "vram-absurd": Row(("plan", "--target", "{target}", "--vram", "99999999999999TiB"), 2, "implausibly large"),
    "n-predict-abc": Row((*BENCH, "--target", "{target}", "--n-predict", "abc"), 2, "'--n-predict'", forbid="╭"),
    "n-predict-abc-value": Row(("bench", "--n-predict=abc"), 2, "(abc); see `specq bench --help`"),
    "unknown-option": Row(("plan", "--bogus"), 2, "No such option: --bogus"),
    "binary-prompt-file": Row((*BENCH, "--target", "{target}", "--prompt-file", "{binary}"), 2, "not UTF-8 text"),
    # a lone surrogate: valid JSON ("\udcff"), or bytes that are not UTF-8 carried in as surrogate escapes (argv)
    "surrogate-in-prompt-jsonl": Row((*BENCH, "--target", "{target}", "--prompt-file", "{surrogate_jsonl}"), 2,
                                     "the prompt at {surrogate_jsonl}:2 is not valid UTF-8 text (a lone surrogate "
                                     "\\udcff at character 2)"),
    "undecodable-prompt-argv": Row((*BENCH, "--target", "{target}", "--prompt", "a\udcffb"), 2,
                                   "--prompt is not valid UTF-8 text"),
    "undecodable-system-argv": Row((*CHAT, "--target", "{target}", "--system", "\udcff"), 2,
                                   "--system is not valid UTF-8 text", stdin="hi\n"),
    # -- outputs are checked before the run: nothing is left behind ----------------------------
    "csv-folder-missing": Row((*BENCH, "--target", "{target}", "--json", "{tmp}/out.json", "--csv",
                               "{tmp}/no/such/runs.csv"), 2, "--csv folder not found", absent=("{tmp}/out.json",)),
    "json-is-a-folder": Row((*BENCH, "--target", "{target}", "--json", "{tmp}", "--csv", "{tmp}/runs.csv"), 2,
                            "--json is a folder", absent=("{tmp}/runs.csv",)),
    "plot-folder-missing": Row((*BENCH, "--target", "{target}", "--draft", "{target}", "--json", "{tmp}/out.json",
                                "--plot", "{tmp}/no/plot.png"), 2, "--plot folder not found",
                               absent=("{tmp}/out.json",)),
    "json-folder-not-writable": Row((*BENCH, "--target", "{target}", "--json", "/proc/specq-out.json"), 2,
                                    "--json is not writable (/proc/specq-out.json)"),
    "tune-json-folder-missing": Row((*TUNE, "--target", "{target}", "--draft", "{target}", "--json",
                                     "{tmp}/no/t.json"), 2, "--json folder not found"),
    # -- pair manifests: a bad value is the manifest's fault (exit 1, naming it and the key) ----
    "manifest-p-min-string": Row(("bench", "--pair", "{pair_p_min}", "--threads", "1"), 1,
                                 "bad p_min in the pair manifest ({pair_p_min}/specq-pair.toml: p_min = 'high')",
                                 forbid="--p-min"),
    "manifest-draft-max-list": Row(("chat", "--pair", "{pair_draft_max}", "--threads", "1"), 1,
                                   "bad draft_max in the pair manifest", stdin="hi\n", forbid="--draft-max"),
    "manifest-draft-max-zero": Row(("bench", "--pair", "{pair_zero}", "--threads", "1"), 1, "draft_max = 0"),
    # -- pairs that run, but not as the user thinks: one loud warning with the fix --------------
    "swapped-pair": Row((*BENCH, "--target", "{target}", "--draft", "{big}"), 0, "are they swapped?"),
    "same-file-twice": Row((*BENCH, "--target", "{target}", "--draft", "{target}"), 0, "the draft is the target itself"),
    # -- chat -----------------------------------------------------------------------------------
    "chat-markup-close-tag": Row((*CHAT, "--target", "{target}"), 1, "/k needs a number ([/bold])", stdin="/k [/bold]\n"),
    "chat-markup-open-tag": Row((*CHAT, "--target", "{target}"), 1, "/k needs a number ([red]x)", stdin="/k [red]x\n"),
    "chat-k-zero": Row((*CHAT, "--target", "{target}"), 1, "/k must be between 1 and", stdin="/k 0\n",
                       forbid="--draft-max"),
    "chat-save-write-error": Row((*CHAT, "--target", "{target}"), 1, "(/proc/specq-chat.json); check the path",
                                 stdin="/save /proc/specq-chat.json\n", forbid=".part"),
    "chat-temp-nan": Row((*CHAT, "--target", "{target}"), 1, "/temp needs a number (nan)", stdin="/temp nan\n"),
    "chat-save-to-folder": Row((*CHAT, "--target", "{target}"), 1, "not a folder", stdin="/save {tmp}\nhello\n"),
    "chat-system-too-long": Row((*CHAT, "--target", "{target}", "--ctx", "64", "--system", "{long_text}"), 1,
                                "the system prompt and this message do not fit", stdin="hi\n", forbid="/reset"),
    "chat-conversation-full": Row(("chat", "--target", "{target}", "--threads", "1", "--ctx", "64"), 1,
                                  "the context is full", stdin="hi\n", forbid="/reset"),
    # -- convert: a checkpoint that does not match its config is refused before anything is written
    "convert-missing-tensor": Row(("convert", "{ck_missing}", "--out", "{tmp}/pair", "--quant", "none"), 1,
                                  "lacks the tensor for blk.0.ffn_up.weight",
                                  absent=("{tmp}/pair/specq-pair.toml", "{tmp}/pair/ck_missing-F32.gguf")),
    "convert-transposed-tensor": Row(("convert", "{ck_transposed}", "--out", "{tmp}/pair", "--quant", "Q8_0"), 1,
                                     "model.layers.0.mlp.down_proj.weight has shape [128, 64], config.json implies "
                                     "[64, 128]", absent=("{tmp}/pair/specq-pair.toml",)),
    "convert-same-checkpoint-twice": Row(("convert", "{ck_good}", "--draft", "{ck_good}", "--out", "{tmp}/pair",
                                          "--quant", "none"), 0, "the draft is the target's own checkpoint"),
}


# ---- the bad files --------------------------------------------------------------------------------
def _drop(name):
    return lambda w: {k: v for k, v in w.items() if k != name}


def _edit(name, fn):
    return lambda w: {**w, name: fn(w[name])}


def _duplicate_token() -> dict[int, str]:
    tokens = vocab(TinySpec().n_merges)[0]
    return {40: tokens[41]}


def _pair(d: Path, target: Path, draft: Path, settings: str) -> Path:
    """A pair folder whose files are valid and whose [settings] hold the given TOML lines."""
    d.mkdir()
    entries = []
    for role, src in (("target", target), ("draft", draft)):
        (d / f"{role}.gguf").write_bytes(src.read_bytes())
        sha = hashlib.sha256((d / f"{role}.gguf").read_bytes()).hexdigest()
        entries.append(f'[{role}]\nfile = "{role}.gguf"\nsha256 = "{sha}"\n')
    (d / "specq-pair.toml").write_text("format_version = 1\n" + "\n".join(entries) + f"\n[settings]\n{settings}\n")
    return d


def _checkpoint(d: Path, edit) -> Path:
    spec = HFSpec(arch="Qwen2ForCausalLM", n_layer=1, dtype="F32")
    write_checkpoint(d, spec)
    st = d / "model.safetensors"
    write_safetensors(st, {k: v.astype(np.float32) for k, v in edit(read_safetensors(st)).items()}, "F32")
    return d


@pytest.fixture(scope="module")
def files(tiny_target, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad-inputs")
    t = Path(tiny_target)
    out = {"target": t}
    out["dup"] = write_tiny_gguf(d / "dup.gguf", seed=1, token_override=_duplicate_token())
    out["short_embd"] = write_tiny_gguf(d / "short_embd.gguf", seed=1, edit_weights=_edit("token_embd.weight", lambda a: a[:300]))
    out["short_output"] = write_tiny_gguf(d / "short_output.gguf", seed=1, edit_weights=_edit("output.weight", lambda a: a[:300]))
    out["missing"] = write_tiny_gguf(d / "missing.gguf", seed=1, edit_weights=_drop("blk.1.ffn_up.weight"))
    out["transposed"] = write_tiny_gguf(d / "transposed.gguf", seed=1,
                                        edit_weights=_edit("blk.0.ffn_down.weight", lambda a: np.ascontiguousarray(a.T)))
    out["no_bos"] = write_tiny_gguf(d / "no_bos.gguf", seed=1, tokenizer_model="t5", bos_id=None, add_bos=True)
    out["truncated"] = d / "truncated.gguf"
    out["truncated"].write_bytes(t.read_bytes()[:300_000])
    out["big"] = write_tiny_gguf(d / "big.gguf", seed=1, spec=TinySpec(n_layer=4))
    out["binary"] = d / "prompt.bin"
    out["binary"].write_bytes(bytes(range(256)) * 4)
    out["surrogate_jsonl"] = d / "surrogate.jsonl"
    out["surrogate_jsonl"].write_text('{"prompt": "fine"}\n{"prompt": "a \\udcff b"}\n')
    out["pair_p_min"] = _pair(d / "pair-p-min", t, t, 'p_min = "high"')
    out["pair_draft_max"] = _pair(d / "pair-draft-max", t, t, "draft_max = [1, 2]")
    out["pair_zero"] = _pair(d / "pair-zero", t, t, "draft_max = 0")
    out["ck_good"] = _checkpoint(d / "ck_good", lambda w: w)
    out["ck_missing"] = _checkpoint(d / "ck_missing", lambda w: {k: v for k, v in w.items()
                                                                 if k != "model.layers.0.mlp.up_proj.weight"})
    out["ck_transposed"] = _checkpoint(d / "ck_transposed", lambda w: {
        **w, "model.layers.0.mlp.down_proj.weight": w["model.layers.0.mlp.down_proj.weight"].T.copy()})
    out["long_text"] = " ".join(["hello world"] * 40)
    return {k: str(v) for k, v in out.items()}


# ---- running a row --------------------------------------------------------------------------------
def run_specq(args, stdin=None, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="80", HF_HUB_OFFLINE="1")
    return subprocess.run([SPECQ, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


def messages(stderr: str) -> list[str]:
    """stderr without chat's closing statistics line (a JSON object)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("{")]


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input(name, files, tmp_path):
    row = ROWS[name]
    fill = {**files, "tmp": str(tmp_path)}
    args = [a.format(**fill) for a in row.args]
    r = run_specq(args, stdin=row.stdin.format(**fill) if row.stdin else None)
    lines = messages(r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == row.code, r.stderr
    kind = "specq: error: " if row.code else "specq: warning: "
    shown = [ln for ln in lines if ln.startswith(kind)]
    assert shown and all(ln.startswith(("specq: error: ", "specq: warning: ")) for ln in lines), r.stderr
    if row.code:
        assert len(lines) == len(shown), r.stderr  # nothing but error lines (one per failed chat turn)
        if row.stdin is None:
            assert len(lines) == 1, r.stderr
    phrase = row.phrase.format(**fill)
    assert any(phrase in ln for ln in shown), r.stderr
    if row.forbid:
        assert not any(row.forbid in ln for ln in shown), r.stderr
    for p in row.absent:
        assert not Path(p.format(**fill)).exists(), p


# ---- beyond one line ------------------------------------------------------------------------------
def test_chat_goes_on_after_a_save_to_a_folder(files, tmp_path):
    r = run_specq([*CHAT, "--target", files["target"]], stdin=f"/save {tmp_path}\nhello\n")
    assert json.loads(r.stderr.strip().splitlines()[-1])["turns"] == 1 and r.stdout.strip()


def test_chat_input_that_is_not_utf8_is_one_line_a_turn_and_exit_1(files):
    r = subprocess.run([SPECQ, *CHAT, "--target", files["target"]], input=b"hi \xff there\nhello\n",
                       capture_output=True, timeout=120, env=dict(os.environ, COLUMNS="80"))
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert messages(err) == ["specq: error: the message is not valid UTF-8 text (a lone surrogate \\udcff at "
                             "character 3); send UTF-8 text without unpaired \\ud800-\\udfff escapes"]
    assert json.loads(err.strip().splitlines()[-1])["turns"] == 1 and r.stdout.strip()  # "hello" was answered


def test_help_texts_print_their_brackets():
    assert "[tuned]" in run_specq(["tune", "--help"]).stdout
    assert "specq[plot]" in run_specq(["bench", "--help"]).stdout.replace("\n", " ").replace(" ", "")


@pytest.mark.parametrize("which, call", [
    ("dup", "C.llama_model_load_from_file(path, C.llama_model_default_params())"),
    ("no_bos", "m = _ffi.Model.__new__(_ffi.Model); m.path = path; "
               "m.vocab = C.llama_model_get_vocab(C.llama_model_load_from_file(path, C.llama_model_default_params())); "
               "m.tokenize('abc')"),
])
def test_without_the_checks_llama_cpp_aborts_and_the_guard_prints_one_line(files, which, call):
    """The files above are refused for a reason: loaded straight into llama.cpp they abort the process.
    The abort callback then prints one specq line and exits 1 (not SIGABRT with a backtrace)."""
    code = ("import llama_cpp.llama_cpp as C\nfrom specq.native.llama import ffi as _ffi\n_ffi.ensure_backend()\n"
            f"path = {files[which].encode()!r}\n{call}\nprint('survived')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "survived" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("specq: error: llama.cpp aborted (") and "GGML_ASSERT" in lines[0]


def test_an_unexpected_exception_is_one_line_and_v_shows_the_traceback(monkeypatch, capsys):
    from specq.cli import usage

    def broken(**kw):
        raise RuntimeError("simulated bug\nin two lines")

    monkeypatch.setattr(usage, "app", broken)
    assert usage.run(["doctor"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["specq: error: internal error (RuntimeError: simulated bug in two lines); this is a "
                                "bug in specq: run again with -v and report the traceback"]
    assert usage.run(["doctor", "-v"]) == 1 and "Traceback" in capsys.readouterr().err


def test_convert_loads_what_it_wrote_before_reporting_success(files, tmp_path, monkeypatch):
    """With the checkpoint check off, the written file is still refused (and removed) by the load check."""
    from specq.convert import pipeline, tensor_jobs
    from specq.errors import ConversionError

    monkeypatch.setattr(tensor_jobs, "check_shapes", lambda *a: None)
    with pytest.raises(ConversionError, match="the converted file does not load .*blk.0.ffn_up.weight is missing"):
        pipeline.convert_pair(files["ck_missing"], tmp_path / "pair", quant=None)
    assert list((tmp_path / "pair").iterdir()) == []


@pytest.mark.parametrize("name, shown", [
    ("/data/.runs.csv.1234.tmp", "/data/runs.csv"), ("/data/.m-Q8_0.gguf.99.part", "/data/m-Q8_0.gguf"),
    ("/data/runs.csv", "/data/runs.csv"), (None, ""),
])
def test_write_errors_name_the_users_path(name, shown):
    from specq.cli.checks import user_path

    assert user_path(name) == shown


def test_interactive_chat_prints_markup_as_typed(files):
    import pexpect

    child = pexpect.spawn(SPECQ, ["chat", "--target", files["target"], "--threads", "1", "--ctx", "256"],
                          encoding="utf-8", timeout=60, dimensions=(40, 200))
    try:
        child.expect("Ctrl-D to leave")
        child.sendline("/k [/bold]")
        child.expect_exact("specq: error: /k needs a number ([/bold]); e.g. /k 4")
        child.sendline("/k [red]x")
        child.expect_exact("specq: error: /k needs a number ([red]x)")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_good_files_pass_the_checks(tiny_target, tiny_close, tmp_path):
    """The checks refuse what llama.cpp refuses, not more: normal models and a vocabulary-only file pass."""
    from specq.native.llama.gguf_check import check_model_file

    vocab_only = write_tiny_gguf(tmp_path / "vocab-only.gguf", seed=1, edit_weights=lambda w: {})
    padded = write_tiny_gguf(tmp_path / "padded.gguf", seed=1, spec=TinySpec(extra_rows=13))
    for p in (tiny_target, tiny_close, vocab_only, padded):
        check_model_file(p)

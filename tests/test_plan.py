"""The VRAM planner on synthetic GGUF headers: a 32B-shaped Qwen2 at Q4_K_M and a 0.5B draft at Q8_0.

The files hold a real header and tensor infos; the data section is a sparse hole (`truncate`), so a
"19 GB" model takes a few kilobytes of disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from specq.errors import PlanError, UsageError
from specq.native.commands import plan as P
from specq.native.llama.gguf_header import read_header

GiB = 1 << 30
Q = gguf.GGMLQuantizationType


def _more_bits(i: int, n: int) -> bool:
    # llama.cpp's Q4_K_M rule: attn_v and ffn_down get Q6_K in the first and last eighth and every third layer.
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_qwen2_header(path: Path, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
                       n_vocab: int, quant: str, tied: bool, n_ctx: int = 32768) -> Path:
    """Header + tensor infos of a Qwen2-architecture GGUF; the data is a sparse hole of the right size."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    hd = n_embd // n_head
    kv = hd * n_head_kv

    def mat(name, rows, cols, qtype):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), rows * cols // block * size, raw_dtype=qtype)

    def vec(name, n):
        w.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n, raw_dtype=Q.F32)

    base = Q.Q4_K if quant == "Q4_K_M" else Q.Q8_0
    mat("token_embd.weight", n_vocab, n_embd, base)
    for i in range(n_layer):
        more = quant == "Q4_K_M" and _more_bits(i, n_layer)
        vec(f"blk.{i}.attn_norm.weight", n_embd)
        mat(f"blk.{i}.attn_q.weight", n_embd, n_embd, base)
        vec(f"blk.{i}.attn_q.bias", n_embd)
        mat(f"blk.{i}.attn_k.weight", kv, n_embd, base)
        vec(f"blk.{i}.attn_k.bias", kv)
        mat(f"blk.{i}.attn_v.weight", kv, n_embd, Q.Q6_K if more else base)
        vec(f"blk.{i}.attn_v.bias", kv)
        mat(f"blk.{i}.attn_output.weight", n_embd, n_embd, base)
        vec(f"blk.{i}.ffn_norm.weight", n_embd)
        mat(f"blk.{i}.ffn_gate.weight", n_ff, n_embd, base)
        mat(f"blk.{i}.ffn_up.weight", n_ff, n_embd, base)
        mat(f"blk.{i}.ffn_down.weight", n_embd, n_ff, Q.Q6_K if more else base)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", n_vocab, n_embd, Q.Q6_K if quant == "Q4_K_M" else base)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    total = sum(gguf.GGUFWriter.ggml_pad(ti.nbytes, w.data_alignment) for t in w.tensors for ti in t.values())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(gguf.GGUFWriter.ggml_pad(size, w.data_alignment) + total)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    target = write_qwen2_header(d / "qwen-32b-q4_k_m.gguf", n_layer=64, n_embd=5120, n_head=40, n_head_kv=8,
                                n_ff=27648, n_vocab=152064, quant="Q4_K_M", tied=False)
    draft = write_qwen2_header(d / "qwen-0.5b-q8_0.gguf", n_layer=24, n_embd=896, n_head=14, n_head_kv=2,
                               n_ff=4864, n_vocab=151936, quant="Q8_0", tied=True)
    return str(target), str(draft)


def _plan(pair, sizes, ctx=None, **kw):
    devices = [P.Device(f"GPU{i}", s, P.RESERVE_BYTES) for i, s in enumerate(sizes)]
    return P.plan(pair[0], pair[1], devices, ctx=ctx, **kw)


def test_synthetic_files_are_sparse_and_read_back(pair):
    target, draft = pair
    st = os.stat(target)
    assert st.st_size > 18 * GiB  # the apparent size of a 32B Q4_K_M model...
    assert st.st_blocks * 512 < 4 * 1024 * 1024  # ...on a few KB of disk
    h = read_header(target)
    assert h.arch == "qwen2" and h.arch_key("block_count") == 64
    assert len(h.tensors) == 2 + 64 * 12 + 1


def test_shapes_match_the_published_sizes(pair):
    t, d = P.model_shape(pair[0]), P.model_shape(pair[1])
    # Qwen2.5-32B-Instruct-Q4_K_M.gguf is 19.85 GB; the 0.5B at Q8_0 is about 0.53 GB.
    assert 19.0e9 < t.file_bytes == t.weights_bytes < 20.5e9
    assert 0.45e9 < d.file_bytes < 0.6e9 and d.weights_bytes == d.file_bytes + d.input_bytes
    assert t.kv_per_token(0, "f16") == 2 * 8 * 128 * 2  # K and V, 8 kv heads of 128, 2 bytes
    assert sum(t.kv_per_token(i, "f16") for i in range(64)) == 256 * 1024
    assert d.output_bytes > d.input_bytes  # tied embeddings: token_embd is loaded again for the output


def test_one_24gib_card_holds_both_fully_with_the_largest_context(pair):
    p = _plan(pair, [24 * GiB])
    assert p.fits and p.full_offload
    assert p.ngl == 65 and p.ngl_draft == 25
    assert p.ctx % 256 == 0 and 8192 <= p.ctx < 32768
    assert p.total_bytes <= p.budget_bytes
    # One more CTX_PAD step of context would not fit.
    assert P.plan(pair[0], pair[1], p.devices, ctx=p.ctx + 256).full_offload is False
    doc = p.to_dict()
    assert set(doc) >= {"fits", "ctx", "budget_bytes", "total_bytes", "target", "draft", "devices", "reason"}
    assert set(doc["target"]) >= {"n_layers", "ngl", "weights_bytes", "kv_bytes"}
    assert doc["devices"][0]["bytes"] == doc["total_bytes"]


def test_two_24gib_cards_split_the_target(pair):
    p = _plan(pair, [24 * GiB, 24 * GiB], ctx=32768)
    assert p.fits and p.full_offload
    doc = p.to_dict()
    layers = [dv["target_layers"] for dv in doc["devices"]]
    assert all(n > 0 for n in layers) and sum(layers) == 65
    assert doc["devices"][0]["draft_layers"] == 25 and doc["devices"][1]["draft_layers"] == 0
    assert all(dv["bytes"] <= dv["budget_bytes"] for dv in doc["devices"])
    assert doc["tensor_split"]["target"] == [float(n) for n in layers]
    # The same context does not fit fully on one card.
    assert not _plan(pair, [24 * GiB], ctx=32768).full_offload


def test_12gib_offloads_part_of_the_target(pair):
    p = _plan(pair, [12 * GiB], ctx=4096)
    assert p.fits and not p.full_offload
    assert p.ngl_draft == 25 and 20 < p.ngl < 65
    assert p.total_bytes <= p.budget_bytes
    assert "partly offloaded" in p.reason
    # Automatic context on a card too small for everything: the default context, partial offload.
    auto = _plan(pair, [12 * GiB])
    assert auto.ctx == P.DEFAULT_CTX and auto.ngl == p.ngl


@pytest.mark.parametrize("ctx", [2048, 8192])
def test_more_budget_never_means_fewer_layers(pair, ctx):
    prev = -1
    for gib in np.arange(2.0, 40.0, 0.5):
        p = _plan(pair, [int(gib * GiB)], ctx=ctx)
        ngl = p.ngl if p.fits else -1
        assert ngl >= prev, f"{gib} GiB gave {ngl} layers after {prev}"
        prev = ngl
    assert prev == 65


@pytest.mark.parametrize("sizes", [[3 * GiB], [16 * GiB], [24 * GiB], [11 * GiB, 7 * GiB], [24 * GiB] * 2])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_never_plans_more_than_the_budget(pair, sizes, cache_type):
    p = _plan(pair, sizes, cache_type=cache_type)
    assert p.fits
    doc = p.to_dict()
    assert doc["total_bytes"] <= doc["budget_bytes"]
    for dv in doc["devices"]:
        assert dv["bytes"] <= dv["budget_bytes"]
    # The parts add up: weights + KV + compute + reserve is what the devices hold.
    parts = sum(doc[m][k] for m in ("target", "draft") for k in ("weights_bytes", "kv_bytes", "compute_bytes"))
    assert parts + sum(dv["reserve_bytes"] for dv in doc["devices"]) == doc["total_bytes"]


def test_q8_0_cache_fits_a_longer_context(pair):
    f16 = _plan(pair, [24 * GiB])
    q8 = _plan(pair, [24 * GiB], cache_type="q8_0")
    assert q8.ctx > f16.ctx


def test_refuses_when_the_draft_alone_does_not_fit(pair):
    p = _plan(pair, [int(1.5 * GiB)], ctx=4096)
    assert not p.fits and p.ngl == 0
    assert "draft alone does not fit" in p.reason and "GiB" in p.reason and "ctx 4096" in p.reason
    with pytest.raises(PlanError, match="draft alone does not fit"):
        P.choose_layers(pair[0], pair[1], "1.5GiB", 4096)


def test_choose_layers_with_an_absolute_budget(pair):
    ngl, ngl_draft, p = P.choose_layers(pair[0], pair[1], "12GiB", 4096)
    assert (ngl, ngl_draft) == (p.ngl, p.ngl_draft) and ngl_draft == 25 and 0 < ngl < 65


def test_choose_layers_fraction_needs_a_gpu(pair):
    # This machine's llama.cpp is a CPU-only build: a fraction of free VRAM means nothing there.
    with pytest.raises(PlanError, match="needs a GPU"):
        P.choose_layers(pair[0], pair[1], 0.9, 4096)


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * GiB), ("24GB", 24 * 10**9), ("22.5GiB", int(22.5 * GiB)), ("24000MiB", 24000 << 20),
    ("24 gib", 24 * GiB), ("512MB", 512 * 10**6),
])
def test_parse_size(text, expected):
    assert P.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["24", "GiB", "24GiBs", "-1GiB", "24 G B", "", "0GiB", "1e3GiB", "twelve"])
def test_parse_size_rejects(bad):
    with pytest.raises(UsageError):
        P.parse_size(bad)


def test_parse_budget():
    assert P.parse_budget("0.9") == 0.9
    assert P.parse_budget("1") == 1.0
    assert P.parse_budget("24GiB,22.5GiB") == [24 * GiB, int(22.5 * GiB)]
    for bad in ["0", "1.5", "-0.2", "24GiB,", ",", "24GiB,,24GiB", "2"]:
        with pytest.raises(UsageError):
            P.parse_budget(bad)


# ---- the CLI -----------------------------------------------------------------------------------
def _cli(*args):
    from typer.testing import CliRunner

    from specq.cli.main import app

    return CliRunner().invoke(app, ["plan", *args])


def test_cli_plan_json(pair):
    import json

    r = _cli("--target", pair[0], "--draft", pair[1], "--vram", "24GiB,24GiB", "--ctx", "8192", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["fits"] is True and doc["ctx"] == 8192 and len(doc["devices"]) == 2
    assert {"name", "bytes"} <= set(doc["devices"][0])
    assert doc["target"]["ngl"] == 65 and doc["draft"]["ngl"] == 25


def test_cli_plan_partial_offload_exits_0(pair):
    r = _cli("--target", pair[0], "--draft", pair[1], "--vram", "12GiB")
    assert r.exit_code == 0, r.output
    assert "partial offload" in r.stdout and "--ngl-draft 25" in r.stdout


def test_cli_plan_refuses_with_one_line(pair):
    r = _cli("--target", pair[0], "--draft", pair[1], "--vram", "1GiB")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specq: error: the draft alone does not fit")


@pytest.mark.parametrize("bad", ["24", "24GiB,", "lots", "1.5"])
def test_cli_plan_malformed_size_exits_2(pair, bad):
    r = _cli("--target", pair[0], "--vram", bad)
    assert r.exit_code == 2
    assert r.stderr.strip().startswith("specq: error:") and len(r.stderr.strip().splitlines()) == 1


def test_the_draft_is_never_planned_onto_a_remote_device(tiny_target, tiny_close):
    from specq.native.commands.plan import Device, plan

    remote = Device("RPC0", 8 << 30, 0, "10.0.0.2:50052")
    p = plan(str(tiny_target), str(tiny_close), [remote, Device("GPU0", 1 << 30, 0)], ctx=512)
    assert p.fits and p.fill.layers["draft"] == [0, p.ngl_draft] and p.ngl_draft > 0
    alone = plan(str(tiny_target), str(tiny_close), [remote], ctx=512)
    assert alone.fits and alone.ngl_draft == 0 and alone.fill.layers.get("draft") is None
    assert alone.fill.layers["target"] == [alone.ngl] and "draft on this machine's CPU" in alone.reason


def test_parallel_sequences_each_get_their_own_kv_cache(pair):
    one, four = _plan(pair, [48 * GiB], ctx=8192), _plan(pair, [48 * GiB], ctx=8192, parallel=4)
    for which in ("target", "draft"):
        kv1, kv4 = one.to_dict()[which]["kv_bytes"], four.to_dict()[which]["kv_bytes"]
        assert kv1 > 0 and kv4 == 4 * kv1
    assert four.to_dict()["parallel"] == 4 and "each of 4 sequences" in four.reason
    # with the context left to the planner, four sequences get about a quarter of one's
    auto1, auto4 = _plan(pair, [32 * GiB]), _plan(pair, [32 * GiB], parallel=4)
    assert auto1.full_offload and auto4.full_offload and auto4.ctx < auto1.ctx
    r = _cli("--target", pair[0], "--draft", pair[1], "--vram", "48GiB", "--ctx", "8192", "--parallel", "4", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["target"]["kv_bytes"] == four.to_dict()["target"]["kv_bytes"]

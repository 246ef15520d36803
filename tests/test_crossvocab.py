"""A draft of another vocabulary (core/vocabmap.py, drafters/crossvocab.py): exact at every temperature under both
translations, on a control pair whose target is the draft itself over a re-indexed vocabulary (ids permuted, rows
moved, ~10% of the tokens split in two), and the text moves between real tokenizers as it should."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import demo_available
import llama_vocabs
from hfmodels import HFSpec, train_spm, write_spm_checkpoint
from specq.convert.pipeline import convert_pair
from specq.errors import IncompatibleDraftError
from specq.native.core import vocabmap
from specq.native.core.accept import rejection_emit
from specq.native.core.constraint import compile_constraint
from specq.native.core.sampling import SparseDist, sample
from specq.native.core.settings import GenerationSettings
from specq.native.drafters import crossvocab
from specq.native.drafters.crossvocab import CrossVocabDrafter, DraftText, string_proposal
from specq.native.llama import ffi as _ffi
from specq.native.runtime.batch import Batch
from specq.native.control.translation import BLOCK, EXPLORE, TranslationScores
from specq.native.runtime.engine import Engine, SimulatedClock
from stats import chi2_pvalue
from test_constrained import ABC, OBJECT, abc_law
from test_exactness import target_law
from tinymodels import BIGRAM, merge_leaves, write_bigram_gguf, write_reindexed, write_tiny_over_vocab

REMOVED = merge_leaves(BIGRAM)[:32]  # of the tiny vocabulary's 322 tokens: their text splits in two in the target
PROMPTS = ["The quick brown", "Speculative decoding", "for i in range(10):", "你好，世界。 emoji: 🙂"]
MAPS = ["tli", "string"]
TEXTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "你好，世界。今天天气很好。 emoji: 🙂🚀 ok",
         "  two  spaces   three\n\n\tand tabs\t\there", "numbers 12345 67890 and 3.14159"]


@pytest.fixture(scope="module")
def control(models_dir):
    draft = write_bigram_gguf(models_dir / "bigram.gguf", mix=1.0)
    target = write_reindexed(models_dir / "bigram_reindexed.gguf", draft, REMOVED, spec=BIGRAM, seed=5)
    return target, draft


def test_the_control_pair_is_classified_and_bridged(control):
    target, draft = control
    with Engine(target, draft, ctx=256, threads=1) as e:
        assert e.vocabulary == vocabmap.DIFFERENT and e.vocab_map == "auto"
        bridge = e.vocab_bridge
        assert bridge.n_shared == e.target.n_vocab - 3  # every text token of the target; control tokens never
        for d in range(e.draft.n_vocab):
            t = int(bridge.d2t[d])
            assert (t >= 0) == (e.draft.piece(d) not in {e.draft.piece(i) for i in range(3)}
                                and e.draft.token_text(d).decode() not in REMOVED)
            if t >= 0:
                assert e.target.piece(t) == e.draft.piece(d)
        assert 0.25 < e.vocab_overlap < 1.0
    with Engine(draft, draft, ctx=256, threads=1) as e:
        assert e.vocabulary == vocabmap.SAME and e.vocab_bridge is None


@pytest.mark.parametrize("vocab_map", MAPS)
def test_greedy_output_is_the_targets_and_nearly_all_drafts_pass(control, vocab_map):
    # the same-vocabulary acceptance is 1 (the draft is the target's own network): both translations reach 0.9
    target, draft = control
    s = GenerationSettings(n_predict=48, draft_max=4)
    drafted = accepted = 0
    words = set()
    with Engine(target, ctx=256, threads=1) as alone, Engine(target, draft, ctx=256, threads=1,
                                                             vocab_map=vocab_map) as e:
        for prompt in PROMPTS:
            toks = e.tokenize(prompt)
            ref = alone.session().generate(toks, s, speculative=False).run().tokens
            g = e.session().generate(toks, s).run()
            assert g.tokens == ref and len(set(ref)) >= 3  # not one token repeated
            words |= set(ref)
            drafted, accepted = drafted + g.stats.n_drafted, accepted + g.stats.n_accepted
    assert drafted > 100 and accepted >= 0.9 * drafted and len(words) >= 10


def removed_mass(draft_path, target_path, prompt: str, top_k: int) -> float:
    """The most probability, over the target's likely first tokens (≥ 0.05 in its top-k), that the draft's top-k
    distribution
    at the first drafted position puts on tokens the target lacks: a reference from the GGUFs' token texts and the
    draft's own tokenizer, sharing nothing with the bridge."""
    worst = 0.0
    with _ffi.Model(draft_path) as d, _ffi.Model(target_path) as t, _ffi.Context(d, 128, 1) as dc, \
            _ffi.Context(t, 128, 1) as tc:
        gone = np.array([d.token_text(i).decode() in REMOVED for i in range(d.n_vocab)])
        toks = t.tokenize(prompt, add_special=False)
        tc.decode(toks, 0)
        z = np.array(tc.logits(1)[0], np.float64)
        top = np.argsort(z)[-top_k:]
        p = np.exp(z[top] - z[top].max())
        for first in top[p / p.sum() >= 0.05]:
            dc.clear()
            dtoks = d.tokenize(prompt + t.detokenize([int(first)]), add_special=False)
            dc.decode(dtoks, 0)
            r = np.array(dc.logits(1)[0], np.float64)
            keep = np.argsort(r)[-top_k:]
            q = np.exp(r[keep] - r[keep].max())
            worst = max(worst, float(q[gone[keep]].sum() / q.sum()))
    return worst


@pytest.mark.parametrize("vocab_map,prompt", [("tli", "Speculative"), ("string", "for i in")])
def test_the_joint_law_of_the_first_tokens_is_the_targets_at_temperature_1(control, vocab_map, prompt):
    # the first token comes from the target's prefill; the next two are drafted (through the translation) and
    # verified. For TLI the prompt lets the test tell a TLI that skips the renormalisation over shared tokens: at
    # the first drafted position the draft puts over 0.3 of its mass on tokens the target lacks. For the string
    # path, one after which the draft's text reaches a word's end within the draft (held_back) often.
    target, draft = control
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    if vocab_map == "tli":
        assert removed_mass(draft, target, prompt, top_k=4) > 0.3
    with Engine(target, draft, ctx=128, threads=1, vocab_map=vocab_map) as e:
        toks = e.tokenize(prompt)
        law = target_law(target, toks, 3, top_k=4)
        ses, counts, drafted, accepted = e.session(), {}, 0, 0
        for seed in range(3000):
            ses.reset()
            g = ses.generate(toks, GenerationSettings(seed=seed, n_predict=3, draft_max=2, **kw)).run()
            counts[tuple(g.tokens[:3])] = counts.get(tuple(g.tokens[:3]), 0) + 1
            drafted, accepted = drafted + g.stats.n_drafted, accepted + g.stats.n_accepted
    assert drafted > 500 and accepted > 300
    assert chi2_pvalue(counts, law) > 0.001


def test_a_tli_draft_carried_to_target_ids_keeps_the_targets_law(control):
    # On the control pair's real bridge: a draft row with half its mass on tokens the target lacks (and two draft
    # tokens of one target id), carried to target ids (the verify's q), then rejection sampling against a target
    # law unlike the draft's: the emitted tokens follow the target's law. A q left unnormalised over the shared
    # tokens (half the mass) over-accepts, and the test fails.
    target, draft = control
    with _ffi.Model(target, vocab_only=True) as t, _ffi.Model(draft, vocab_only=True) as d:
        bridge = vocabmap.VocabBridge(vocabmap.Tokenizer(t), vocabmap.Tokenizer(d))
        gone = [i for i in range(d.n_vocab) if d.token_text(i).decode() in REMOVED][:3]
    shared = [int(x) for x in bridge.shared_d[10:16]]
    ids = np.array(shared + gone, np.int32)
    q_draft = SparseDist(ids, np.array([0.05, 0.1, 0.05, 0.15, 0.1, 0.05, 0.2, 0.2, 0.1]))
    q, mass = bridge.carry(q_draft)
    assert mass == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    law = dict(zip(map(int, q.ids), rng.dirichlet(np.ones(len(q.ids)))))
    p = SparseDist(np.array(list(law), np.int32), np.array(list(law.values())))
    counts: dict = {}
    for _ in range(20000):
        x = sample(q, rng)
        y = rejection_emit([x], [q], [p, p], rng)[0]
        counts[y] = counts.get(y, 0) + 1
    assert chi2_pvalue(counts, law) > 0.001
    assert q.probs.sum() == pytest.approx(1.0)


class FakeVocab:
    """A vocabulary as VocabBridge reads one: pieces, which are text, and which of several same-bytes ids its
    tokenizer makes."""

    def __init__(self, pieces: list[bytes], control: set[int] = frozenset()):
        self.pieces = pieces
        self.is_text = np.array([i not in control for i in range(len(pieces))])

    def single(self, piece: bytes, ids: list[int]) -> int:
        return max(ids)


def test_same_bytes_sum_onto_one_target_id_and_greedy_takes_the_sum():
    # draft: " " twice (SPM's ▁ and <0x20>), "a", "b", "ab", a control token whose text is a target token's
    draft = FakeVocab([b" ", b"a", b"b", b"ab", b" ", b"<s>", b"zz"], control={5})
    target = FakeVocab([b"<s>", b"ab", b"a", b" ", b"c"], control={0})
    bridge = vocabmap.VocabBridge(target, draft)
    assert bridge.d2t.tolist() == [3, 2, -1, 1, 3, -1, -1]  # "b", "zz" unshared; the control token never crosses
    assert bridge.t2d == {3: 4, 2: 1, 1: 3}  # the draft's own choice of the two spaces (FakeVocab.single)
    row = np.log(np.array([0.2, 0.3, 0.05, 0.05, 0.15, 0.05, 0.2]))  # the spaces sum to 0.35 > "a" 0.3
    projected, mass = bridge.project(row)
    assert mass == pytest.approx(0.7) and np.exp(projected[3]) == pytest.approx(0.35)
    assert np.isneginf(projected[0]) and np.isneginf(projected[4])
    tok, top, mass = bridge.greedy(row, top=2)
    assert (tok, top, mass) == (3, pytest.approx(0.5), pytest.approx(0.7))
    q, m = bridge.carry(SparseDist(np.arange(7, dtype=np.int32), np.exp(row)))
    assert dict(zip(q.ids.tolist(), q.probs)) == pytest.approx({1: 0.05 / 0.7, 2: 0.3 / 0.7, 3: 0.35 / 0.7})
    rng = np.random.default_rng(1)
    for _ in range(200):  # greedy's shortcut always agrees with the whole projection, flat rows included
        r = rng.standard_normal(7) * rng.choice([0.1, 3.0])
        assert bridge.greedy(r, top=1)[0] == int(bridge.project(r)[0].argmax())


@pytest.mark.parametrize("vocab_map", MAPS)
def test_under_a_grammar_greedy_output_is_constrained_decodings_without_a_draft(control, vocab_map):
    # TLI masks its projected rows in target ids; the string path's proposals are cut at the first forbidden token
    target, draft = control
    with Engine(target, draft, ctx=256, threads=1, vocab_map=vocab_map) as e:
        toks = e.tokenize("for i in range(10):")
        s = GenerationSettings(n_predict=40, draft_max=4, constraint=compile_constraint(e.target, OBJECT))
        want = e.session().generate(toks, s, speculative=False).run()
        got = e.session().generate(toks, s).run()
    assert got.tokens == want.tokens and want.text.startswith("{") and len(set(want.tokens)) > 5
    assert got.stats.n_drafted_constrained > 0 and got.stats.n_masks > 0


def test_tli_under_a_grammar_keeps_the_masked_targets_law_at_temperature_1(control):
    target, draft = control
    kw = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, n_predict=3, draft_max=2)
    with Engine(target, draft, ctx=128, threads=1, vocab_map="tli") as e:
        toks = e.tokenize("Speculative")
        c = compile_constraint(e.target, ABC)
        law = abc_law(target, toks, 3)
        ses, counts, drafted, accepted = e.session(), {}, 0, 0
        for seed in range(3000):
            ses.reset()
            g = ses.generate(toks, GenerationSettings(seed=seed, constraint=c, **kw)).run()
            counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
            drafted, accepted = drafted + g.stats.n_drafted_constrained, accepted + g.stats.n_accepted_constrained
    assert drafted > 1000 and 0 < accepted < drafted
    assert chi2_pvalue(counts, law) > 0.001


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_sequences_of_a_batch_draft_together_through_tli_and_each_equals_its_answer_alone(control, temp):
    # one draft decode per position over the sequences still drafting; greedy answers are each one's answer alone
    # (sampled ones follow the same law, shown alone by the chi-square tests; here they must only run and draft)
    target, draft = control
    s = GenerationSettings(n_predict=32, draft_max=4, temp=temp, seed=7)
    with Engine(target, draft, ctx=256, threads=1) as one:
        want = [one.session().generate(one.tokenize(p), s).run().tokens for p in PROMPTS[:3]]
    with Engine(target, draft, ctx=256, threads=1, parallel=3) as e:
        batch = Batch()
        gens = [e.session(i).generate(e.tokenize(p), s) for i, p in enumerate(PROMPTS[:3])]
        for g in gens:
            batch.add(g)
        batch.run()
        batched = sum(e_ses.drafters["model"].n_batched for e_ses in (g.session for g in gens))
    assert batch.most_in_a_step == 3 and batched > 10
    for g, w in zip(gens, want):
        assert (g.tokens == w or temp > 0) and len(g.tokens) == 32 and g.stats.n_drafted > 0


def test_tune_measures_a_translated_draft_and_reports_it(control):
    # tune times the draft on its own tokens (never the target's ids) and says which translation ran
    import json

    from typer.testing import CliRunner

    from specq.cli.main import app

    target, draft = control
    r = CliRunner().invoke(app, ["tune", "--target", str(target), "--draft", str(draft), "--threads", "1",
                                 "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["vocab_map"] == "tli" and 0.25 < doc["vocab_overlap"] < 1
    assert doc["draft_ms"] > 0 and doc["accept_rate"] > 0.5


def test_serve_answers_through_a_translated_draft_and_reports_it(control, tmp_path):
    # a real server (two sequences, both drafting) and the openai client: each completion is the target's own
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from serve_proc import ServerProc

    target, draft = control
    s = GenerationSettings(n_predict=32)
    with Engine(target, ctx=256, threads=1) as alone:
        want = {p: alone.target.detokenize(alone.session().generate(alone.tokenize(p), s, speculative=False)
                                           .run().tokens) for p in PROMPTS[:2]}
    srv = ServerProc(["--target", str(target), "--draft", str(draft), "--parallel", "2", "--draft-max", "4",
                      "--threads", "1", "--ctx", "256"], tmp_path / "serve.log")
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt):
            return c.completions.create(model=Path(target).stem, prompt=prompt, max_tokens=32, temperature=0)

        with ThreadPoolExecutor(2) as pool:
            got = dict(zip(want, pool.map(complete, want)))
        metrics = srv.metrics()
    finally:
        srv.stop()
    for prompt, r in got.items():
        spec = r.usage.model_extra["speculative"]
        assert r.choices[0].text == want[prompt]
        assert spec["vocab_map"] in MAPS and spec["n_drafted"] > 0 and 0.25 < spec["vocab_overlap"] < 1
    assert 0.25 < metrics['specq:draft_vocab_overlap{vocab_map="auto"}'] < 1
    # --vocab-map auto's trial ran both translations, over both requests' steps
    assert metrics['specq:draft_vocab_steps{vocab_map="tli"}'] > 0
    assert metrics['specq:draft_vocab_steps{vocab_map="string"}'] > 0


# ---- --vocab-map auto: the translation chosen by measurement --------------------------------------------------
def test_auto_tries_both_translations_then_drafts_with_the_faster_and_turns_when_it_changes():
    sc = TranslationScores()
    seen = []

    def steps(n, tokens, seconds):  # a step of translation t emits tokens[t] in seconds[t]
        for _ in range(n):
            t = sc.current
            seen.append(t)
            sc.record(t, tokens[t], seconds[t])

    steps(200, {"tli": 3, "string": 2}, {"tli": 1.0, "string": 1.0})
    assert seen[:4 * BLOCK] == (["tli"] * BLOCK + ["string"] * BLOCK) * 2  # the trial: TRIAL steps each
    later = seen[4 * BLOCK:]
    assert 0 < later.count("string") <= len(later) / EXPLORE * BLOCK + BLOCK  # explored, a block in every EXPLORE
    assert sc.best == "tli" and sc.ratio() == pytest.approx(2 / 3)
    steps(200, {"tli": 3, "string": 2}, {"tli": 2.0, "string": 1.0})  # TLI's steps now cost twice as much
    turned = seen[-200 + 2 * EXPLORE:]  # within two explorations
    assert sc.best == "string" and turned.count("string") >= len(turned) - (len(turned) // EXPLORE + 1) * BLOCK


def test_auto_compares_the_translations_on_the_same_text():
    # the text's own pace (tokens a second) changes threefold every 50 steps; the string path is 10% faster on any
    # text: compared block against adjacent block, auto finds it
    sc = TranslationScores()
    seen = []
    for i in range(400):
        pace = 3.0 if (i // 50) % 2 else 1.0
        t = sc.current
        seen.append(t)
        sc.record(t, pace * (2.2 if t == "string" else 2.0), 1.0)
    assert sc.best == "string" and sc.ratio() == pytest.approx(1.1)
    assert seen[-200:].count("string") >= 200 - (200 // EXPLORE + 1) * BLOCK


@pytest.mark.parametrize("shared_min", [None, 0.999])
def test_auto_drafts_with_the_faster_translation_of_the_pair(control, monkeypatch, shared_min):
    # a simulated clock (costs per decode, not this machine's load): each translation forced, then auto over the
    # same prompts; auto tried both, took the faster for most steps, and every answer is the target's own. On the
    # control pair TLI is the faster; a TLI that stops below 99.9% shared mass (drafting seldom) makes the string
    # path the faster
    if shared_min is not None:
        monkeypatch.setattr(crossvocab, "SHARED_MIN", shared_min)
    target, draft = control
    s = GenerationSettings(n_predict=48, draft_max=4)

    def run(vocab_map, rounds):
        clock = SimulatedClock(lambda name, n, pos: 1.0 + 0.02 * n if name == "target" else 0.1)
        out, steps = [], {"tli": 0, "string": 0}
        with Engine(target, draft, ctx=256, threads=1, vocab_map=vocab_map, clock=clock) as e:
            for _ in range(rounds):
                for prompt in PROMPTS:
                    g = e.session().generate(e.tokenize(prompt), s).run()
                    out.append(g.tokens)
                    steps["tli"] += g.stats.n_vocab_tli_steps
                    steps["string"] += g.stats.n_vocab_string_steps
            chosen = e.vocab_chooser and (e.vocab_chooser.greedy.best, e.vocab_translation)
            return sum(map(len, out)) / clock.now, out, steps, chosen

    rates = {m: run(m, 1)[0] for m in MAPS}
    faster = max(rates, key=rates.get)
    assert rates[faster] > 1.2 * min(rates.values())  # a clear winner to find
    _, out, steps, chosen = run("auto", 3)
    with Engine(target, ctx=256, threads=1) as alone:
        ref = [alone.session().generate(alone.tokenize(p), s, speculative=False).run().tokens for p in PROMPTS]
    assert out == ref * 3
    assert chosen == (faster, faster) and steps[faster] > 4 * steps[next(m for m in MAPS if m != faster)] > 0


# ---- the text between tokenizers -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A tiny Llama 2-style model over a SentencePiece vocabulary (byte fallback, a space prefix), converted."""
    d = tmp_path_factory.mktemp("spm")
    src = write_spm_checkpoint(d / "hf", HFSpec(arch="LlamaForCausalLM", seed=20), train_spm())
    return Path(convert_pair(str(src), d / "out").target_path)


@pytest.fixture(scope="module")
def tokenizers(control, spm_model):
    """Tokenizers of the control pair (byte-level BPE), of a SentencePiece model, and SmolLM2's where the demo
    package is installed."""
    target, draft = control
    models = [_ffi.Model(target, vocab_only=True), _ffi.Model(draft, vocab_only=True),
              _ffi.Model(spm_model, vocab_only=True)]
    if demo_available():
        from specq.native.commands.demo import demo_draft_path
        models.append(_ffi.Model(demo_draft_path(), vocab_only=True))
    yield [vocabmap.Tokenizer(m) for m in models]
    for m in models:
        m.close()


def pairs(toks):
    """Every (target, draft) pair of different vocabularies among the tokenizers."""
    return [(a, b) for a in toks for b in toks if a is not b]


@pytest.mark.parametrize("text", TEXTS)
def test_the_drafts_tokens_follow_the_history_token_by_token_and_back(tokenizers, text):
    for tgt, dft in pairs(tokenizers):
        bridge = vocabmap.VocabBridge(tgt, dft)
        dt = DraftText(bridge, None)
        hist = tgt.tokenize(text.encode(), at_start=True)
        for n in list(range(1, len(hist) + 1)) + [len(hist) // 2, len(hist)]:  # grown one by one, cut, grown
            got = dt.sync(hist[:n])
            done = tgt.render(hist[:n])
            done = done[:vocabmap.char_end(done)]
            # the draft holds exactly the committed text, whole characters (and its own space prefix, if any)
            assert dft.render(got) == (b" " if dft.prefix_space and done else b"") + done
        assert dt.sync(hist) == dft.tokenize(tgt.render(hist), at_start=True)


@pytest.fixture(scope="module")
def real_vocabs():
    """llama.cpp's vocabulary files (tests/llama_vocabs.py) as Tokenizers, by name."""
    missing = [n for n in llama_vocabs.NAMES if llama_vocabs.vocab_path(n) is None]
    if missing:
        pytest.skip(f"llama.cpp's vocabulary files are missing ({', '.join(missing)}): python tests/llama_vocabs.py")
    models = {n: _ffi.Model(llama_vocabs.vocab_path(n), vocab_only=True) for n in llama_vocabs.NAMES}
    yield {n: vocabmap.Tokenizer(m) for n, m in models.items()}
    for m in models.values():
        m.close()


@pytest.mark.parametrize("name", llama_vocabs.NAMES)
def test_the_drafts_memory_follows_texts_between_real_vocabularies(real_vocabs, name):
    # llama.cpp's own tokenizer test texts of the target's vocabulary (whitespace runs, accents, CJK, emoji) and
    # ours, grown token by token, cut back and grown again, with every other vocabulary as the draft
    tgt = real_vocabs[name]
    texts = [t for t in llama_vocabs.inp_texts(name) + TEXTS if t]
    assert len(texts) > 20
    for dname, dft in real_vocabs.items():
        if dname == name:
            continue
        bridge, same = vocabmap.VocabBridge(tgt, dft), 0
        for text in texts:
            dt = DraftText(bridge, None)
            hist = tgt.tokenize(text.encode(), at_start=True)
            for n in list(range(1, len(hist) + 1)) + [len(hist) // 2, len(hist)]:
                got = dt.sync(hist[:n])
                done = tgt.render(hist[:n])
                done = done[:vocabmap.char_end(done)]
                assert dft.render(got) == (b" " if dft.prefix_space and done else b"") + done, (dname, text)
            same += dt.sync(hist) == dft.tokenize(tgt.render(hist), at_start=True)
        assert same >= 0.9 * len(texts), (dname, same, len(texts))  # mostly the draft's own split of the text


@pytest.mark.parametrize("name", llama_vocabs.NAMES)
def test_the_string_path_holds_back_the_last_word_in_real_vocabularies(real_vocabs, name):
    tgt = real_vocabs[name]
    full = tgt.tokenize("The quick brown fox jumps over the lazy dog, 你好 🙂".encode(), at_start=True)
    hist = tgt.tokenize(b"The quick brown", at_start=True)
    assert full[:len(hist)] == hist
    got = string_proposal(tgt, hist, b" fox jum", ended=False)
    assert got == full[len(hist):len(hist) + len(got)] and tgt.render(got) == b" fox"
    got = string_proposal(tgt, hist, " fox jumps over the lazy dog, 你好 🙂".encode(), ended=True)
    assert got == full[len(hist):]


@pytest.fixture(scope="module")
def over_vocab(real_vocabs, models_dir):
    """A tiny random model over one of llama.cpp's vocabulary files, written once per module (copying a 262k-token
    vocabulary takes gguf-py seconds)."""
    made: dict[str, Path] = {}

    def get(name: str, seed: int) -> Path:
        if name not in made:
            made[name] = write_tiny_over_vocab(models_dir / f"over-{name}.gguf", llama_vocabs.vocab_path(name), seed)
        return made[name]
    return get


@pytest.mark.parametrize("vocab_map", MAPS)
@pytest.mark.parametrize("target_vocab,draft_vocab", [("gemma-4", "qwen2"), ("llama-spm", "gpt-2")])
def test_greedy_output_is_the_targets_over_real_vocabularies(over_vocab, monkeypatch, target_vocab, draft_vocab,
                                                            vocab_map):
    # tiny random models over llama.cpp's vocabulary files (their tokenizers whole): answers of rare tokens, cut
    # characters and whitespace runs; a random draft shares little mass, so the overlap floor is lowered
    monkeypatch.setattr(vocabmap, "OVERLAP_MIN", 0.0)
    target, draft = over_vocab(target_vocab, 1), over_vocab(draft_vocab, 2)
    assert_greedy_identity(target, draft, vocab_map, TEXTS[:2], GenerationSettings(n_predict=24, draft_max=3))


def assert_greedy_identity(target, draft, vocab_map: str, prompts: list[str], s: GenerationSettings) -> None:
    """Through the translation, every greedy answer is the target alone's (not one token repeated), and drafting
    happened."""
    with Engine(target, draft, ctx=256, threads=1, vocab_map=vocab_map) as e:
        assert e.vocabulary == vocabmap.DIFFERENT
        drafted = 0
        for prompt in prompts:
            toks = e.tokenize(prompt)
            ref = e.session().generate(toks, s, speculative=False).run().tokens
            g = e.session().generate(toks, s).run()
            assert g.tokens == ref and len(set(ref)) > 3
            drafted += g.stats.n_drafted
    assert drafted > 0


def test_a_space_prefixing_tokenizer_is_recognised(tokenizers):
    assert [t.prefix_space for t in tokenizers[:3]] == [False, False, True]


@pytest.mark.parametrize("vocab_map", MAPS)
@pytest.mark.parametrize("spm_side", ["target", "draft"])
def test_greedy_output_is_the_targets_across_bpe_and_sentencepiece(tiny_target, spm_model, vocab_map, spm_side):
    # random weights: text full of byte tokens and cut characters, which the draft's memory must follow
    bpe = tiny_target
    target, draft = (spm_model, bpe) if spm_side == "target" else (bpe, spm_model)
    assert_greedy_identity(target, draft, vocab_map, TEXTS, GenerationSettings(n_predict=40, draft_max=4))


def test_a_draft_that_needs_more_tokens_than_its_context_holds_stops_drafting(tiny_target, spm_model):
    # random bytes take the SentencePiece draft (byte fallback) more tokens than the byte-level BPE target: with
    # a context of the target's size the draft would overflow; it is given more, and past that it stops drafting
    s = GenerationSettings(n_predict=60, draft_max=4)
    with Engine(tiny_target, spm_model, ctx=128, threads=1, draft_ctx=None) as e:
        assert e.dft_ctx.n_ctx >= 192  # (llama.cpp rounds it up)
        toks = e.tokenize("你好，世界。今天天气很好。 emoji: 🙂🚀 ok 12345")
        ref = e.session().generate(toks, s, speculative=False).run().tokens
        g = e.session().generate(toks, s).run()
        assert g.tokens == ref and g.stats.n_vocab_full > 0 and g.stats.n_drafted > 0


def test_the_string_path_proposes_only_tokens_more_text_cannot_change(tokenizers):
    for tgt, _ in pairs(tokenizers):
        full = tgt.tokenize(b"The quick brown fox jumps over the lazy dog", at_start=True)
        hist = tgt.tokenize(b"The quick brown", at_start=True)
        assert full[:len(hist)] == hist
        got = string_proposal(tgt, hist, b" fox jum", ended=False)
        assert got == full[len(hist):len(hist) + len(got)]  # " jum" would become " jumps": not proposed
        assert tgt.render(got) == b" fox"
        assert string_proposal(tgt, hist, b" fox jumps over", ended=True) == \
            tgt.tokenize(b"The quick brown fox jumps over", at_start=True)[len(hist):]
        ok = tgt.tokenize(b"ok", at_start=True)
        half = " 🙂".encode() + "🚀".encode()[:2]  # a character cut in two: never proposed
        assert tgt.render(string_proposal(tgt, ok, half, ended=True)) == " 🙂".encode()


def test_the_drafts_memory_holds_the_committed_text_after_each_step(control, monkeypatch):
    target, draft = control
    seen = []
    rewind = CrossVocabDrafter.rewind

    def spy(self):
        rewind(self)
        want = self.text.sync(self.session.history)
        seen.append(len(self.memory.tokens) <= len(want) and self.memory.tokens == want[:len(self.memory.tokens)])

    monkeypatch.setattr(CrossVocabDrafter, "rewind", spy)
    for vocab_map in MAPS:
        with Engine(target, draft, ctx=256, threads=1, vocab_map=vocab_map) as e:
            g = e.session().generate(e.tokenize("Speculative decoding"),
                                     GenerationSettings(n_predict=40, draft_max=6, temp=0.8, seed=3)).run()
            assert g.stats.n_drafted > g.stats.n_accepted > 0  # partial acceptances happened
    assert len(seen) > 10 and all(seen)


def test_a_draft_sharing_too_little_is_one_clear_line_and_auto_drafts_through_text(control, monkeypatch, caplog):
    # below the floor TLI cannot help: forced, it is refused; under auto the string path drafts alone, exactly
    target, draft = control
    monkeypatch.setattr(vocabmap, "OVERLAP_MIN", 0.99)
    share = r"only \d+% of its probability mass falls on the \d+ tokens they share \(TLI needs 99% to help\)"
    with pytest.raises(IncompatibleDraftError, match=share + "; --vocab-map string drafts through text instead"):
        Engine(target, draft, ctx=128, threads=1, vocab_map="tli")
    s = GenerationSettings(n_predict=24, draft_max=4)
    with caplog.at_level("WARNING", logger="specq.engine"), Engine(target, draft, ctx=128, threads=1) as e:
        g = e.session().generate(e.tokenize(PROMPTS[0]), s).run()
        assert e.vocab_translation == "string" and e.vocab_chooser is None
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert caplog.records[0].getMessage().endswith("the string path drafts alone")
    assert g.stats.n_vocab_string_steps > 0 and g.stats.n_vocab_tli_steps == 0 and g.stats.n_drafted > 0
    with Engine(target, ctx=128, threads=1) as alone:
        assert g.tokens == alone.session().generate(alone.tokenize(PROMPTS[0]), s, speculative=False).run().tokens


def test_char_end_keeps_whole_characters():
    s = "a🙂é".encode()
    assert [vocabmap.char_end(s[:n]) for n in range(len(s) + 1)] == [0, 1, 1, 1, 1, 5, 5, 7]

"""--drafter suffix (native/drafters/suffix.py): a store of earlier answers every sequence and request of an engine
shares, and the request's own text; the longest ending matched, a path grown by the most frequent continuation,
exact output whatever it proposes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specq.native.core.settings import GenerationSettings
from specq.native.drafters import suffix
from specq.native.drafters.suffix import SuffixIndex, SuffixStore, cache_bytes, read_cache
from specq.native.runtime.engine import Engine
from stats import chi2_pvalue
from test_exactness import sampled_law, target_law


# ---- the index and the store, on plain lists ------------------------------------------------------------------
def test_the_longest_ending_chooses_the_occurrences_and_the_most_frequent_continuation_leads():
    idx = SuffixIndex()
    idx.extend(0, [9, 1, 2, 3, 4, 50, 51])
    idx.extend(1, [8, 8, 2, 3, 4, 60, 61])  # a shorter match of the ending (2 3 4, not 1 2 3 4)
    idx.extend(2, [7, 1, 2, 3, 4, 50, 52])
    path = idx.path([5, 1, 2, 3, 4], 8)
    assert path.match == 4  # 1 2 3 4: sequences 0 and 2, not 1
    assert path.tokens == [50, 52] and path.probs == [1.0, 0.5]  # 51 and 52 tie: the most recent answer's first
    short = idx.path([5, 5, 2, 3, 4], 8)  # three occurrences of a 3-token match: 50 leads two to one
    assert short.match == 3 and short.tokens[:1] == [50] and short.probs[0] == pytest.approx(2 / 3)
    assert idx.path([5, 5, 5, 3, 4], 8).tokens == []  # shorter than KEY: nothing


def test_a_path_stops_below_the_least_probability_and_at_its_share_of_the_match():
    idx = SuffixIndex()
    for i in range(12):  # after 1 2 3: 40 always, then a different token each time
        idx.extend(i, [1, 2, 3, 40, 100 + i, 7, 7])
    path = idx.path([1, 2, 3], 8)
    assert path.tokens == [40]  # 1/12 < MIN_TOKEN_PROB stops the path at the second token
    idx = SuffixIndex()
    idx.extend(0, list(range(100)))
    assert len(idx.path([10, 11, 12], 20).tokens) == int(suffix.MAX_SPEC_FACTOR * 3)  # a 3-token match
    assert idx.path(list(range(20, 40)), 50).tokens == list(range(40, 40 + min(suffix.MAX_DEPTH, 20)))


def test_the_store_drops_its_oldest_answers_by_tokens_and_by_answers():
    st = SuffixStore(max_tokens=30, max_answers=3)
    for i in range(5):
        st.add([1000 * i + j for j in range(10)])
    assert st.n_answers == 3 and st.index.n_tokens == 30
    assert st.index.path([1000, 1001, 1002], 8).tokens == []  # the two oldest answers are gone: never proposed
    assert st.index.path([4000, 4001, 4002], 8).tokens == [4003, 4004, 4005]
    assert (1000, 1001, 1002) not in st.index.where and len(st.index.where) == 3 * 8  # dropped with their answers
    st.add(list(range(31)))  # longer than the whole store: not kept
    assert st.n_answers == 3


def test_the_cache_file_reads_back_and_refuses_corrupt_truncated_foreign_and_other_vocabularies():
    answers = [[1, 2, 3, 4], [], [70000, 5, 6, 7, 8]]
    data = cache_bytes(answers, b"vocab-a")
    assert read_cache(data, b"vocab-a") == answers
    flipped = bytearray(data)
    flipped[20] ^= 1
    for bad, why in ((data[:-1], "corrupt or truncated"), (bytes(flipped), "corrupt or truncated"),
                     (b"GGUF" + data[4:], "not a specq suffix cache"), (data, "another vocabulary")):
        with pytest.raises(ValueError, match=why):
            read_cache(bad, b"vocab-b" if bad is data else b"vocab-a")


def test_a_store_saves_off_the_engine_thread_while_answers_come(tmp_path, monkeypatch):
    monkeypatch.setattr(suffix, "SAVE_EVERY_S", 0.0)
    st = SuffixStore(path=tmp_path / "s.sfx", fingerprint=b"v")
    st.add([1, 2, 3, 4, 5])
    st.writer.join()
    assert st.n_saves == 1 and read_cache((tmp_path / "s.sfx").read_bytes(), b"v") == [[1, 2, 3, 4, 5]]
    assert st.writer.name == "specq-suffix-cache" and st.pause_s < 0.1
    st.add([6, 7, 8, 9])
    st.close()  # waits for a save under way, then writes the store as it ends
    loaded = SuffixStore(path=tmp_path / "s.sfx", fingerprint=b"v")
    loaded.load()
    assert loaded.answers() == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    (tmp_path / "s.sfx").write_bytes(b"junk")
    fresh_store = SuffixStore(path=tmp_path / "s.sfx", fingerprint=b"v")
    fresh_store.load()
    assert fresh_store.n_answers == 0


# ---- through the engine: exact, the store shared, only finished answers ---------------------------------------
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine(tiny_target):
    with Engine(tiny_target, None, ctx=512, threads=1) as e:
        yield e


def store_of(e: Engine) -> SuffixStore:
    return e.provided["suffix"]


def fresh(e: Engine) -> None:
    e.provided["suffix"] = SuffixStore()


def test_a_second_request_drafts_its_answer_from_the_store_exactly(engine):
    fresh(engine)
    toks = engine.tokenize(PROMPT)
    s = GenerationSettings(n_predict=64, draft_max=8, drafter="suffix")
    base = engine.session().generate(toks, s, speculative=False).run()
    assert store_of(engine).n_answers == 0  # the target alone (a reference: bench's baseline) is not served
    first = engine.session().generate(toks, s).run()
    assert first.tokens == base.tokens and first.stats.n_drafted_store == 0 and store_of(engine).n_answers == 1
    g = engine.session().generate(toks, s).run()
    st = g.stats
    assert g.tokens == base.tokens and len(set(base.tokens)) > 10
    assert st.n_drafted_store > 0 and st.n_accepted_store > 0, st
    assert dict(st.n_drafted_by)["suffix"] == st.n_drafted_store + st.n_drafted_text
    assert dict(st.n_accepted_by)["suffix"] == st.n_accepted_store + st.n_accepted_text
    # the answer was there whole: most of it came from drafts the target accepted
    assert st.n_accepted_store >= 0.6 * len(g.tokens), st


def test_an_interrupted_generation_leaves_nothing_in_the_store(engine):
    fresh(engine)
    s = GenerationSettings(n_predict=64, drafter="suffix")
    it = iter(engine.session().generate(engine.tokenize(PROMPT), s))
    for _ in range(20):
        next(it)
    it.close()
    assert store_of(engine).n_answers == 0
    engine.session().generate(engine.tokenize(PROMPT), s).run()
    assert store_of(engine).n_answers == 1


def test_under_auto_a_filled_store_drafts_exactly(engine):
    fresh(engine)
    toks = engine.tokenize("The quick brown fox")
    s = GenerationSettings(n_predict=64, draft_max=8, drafter="auto")
    first = engine.session().generate(toks, s).run()
    assert first.stats.n_drafted_store == 0
    second = engine.session().generate(toks, s).run()
    assert second.tokens == first.tokens and len(set(first.tokens)) > 10
    assert second.stats.n_drafted_store > 0 and second.stats.n_accepted_store > 0, second.stats


def test_bench_drafts_from_the_store_as_loaded_and_adds_none_of_its_answers(tiny_target, tmp_path):
    from typer.testing import CliRunner
    from specq.cli.app import app

    def bench(*extra) -> dict:
        r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--threads", "1", "--ctx", "256",
                                     "--n-predict", "32", "--prompt", PROMPT, "--drafter", "suffix", "--draft-max",
                                     "8", "--json", "-", "-q", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    doc = bench("--repeat", "2")
    spec = [x for x in doc["runs"] if x["mode"] == "speculative"]
    assert doc["summary"]["identical_output"] is True and [x["n_drafted_store"] for x in spec] == [0, 0]
    cache = tmp_path / "c.sfx"
    with Engine(tiny_target, None, ctx=256, threads=1, suffix_cache=str(cache)) as e:
        e.session().generate(e.tokenize(PROMPT), GenerationSettings(n_predict=32, drafter="suffix")).run()
    doc = bench("--suffix-cache", str(cache))
    spec = next(x for x in doc["runs"] if x["mode"] == "speculative")
    assert doc["summary"]["identical_output"] is True and spec["n_accepted_store"] > 0


def test_scope_request_keeps_no_store(tiny_target):
    with Engine(tiny_target, None, ctx=256, threads=1, suffix_scope="request") as e:
        assert "suffix" not in e.provided
        toks = e.tokenize(PROMPT)
        s = GenerationSettings(n_predict=48, draft_max=8, drafter="suffix")
        first = e.session().generate(toks, s).run()
        again = e.session().generate(toks, s).run()
    assert again.tokens == first.tokens and again.stats.n_drafted_store == 0


def test_sequences_of_one_engine_share_one_store(tiny_target):
    with Engine(tiny_target, None, ctx=256, threads=1, parallel=2) as e:
        a, b = e.session(0), e.session(1)
        toks = e.tokenize(PROMPT)
        s = GenerationSettings(n_predict=48, draft_max=8, drafter="suffix")
        alone = a.generate(toks, s, speculative=False).run()
        a.reset()
        first = a.generate(toks, s).run()  # sequence 0's answer enters the engine's store...
        g = b.generate(toks, s).run()  # ...and sequence 1 drafts from it
    assert g.tokens == first.tokens == alone.tokens and g.stats.n_accepted_store > 0


# ---- sampled drafts at T > 0: drawn from the followers' counts, their law the verify's q -----------------------
class Law:
    """A Sampling stand-in for draw: a seeded generator and, optionally, a constraint's mask."""

    def __init__(self, seed: int = 0, allowed=None):
        self.rng = np.random.default_rng(seed)
        self.guide = None if allowed is None else type("Guide", (), {"allowed": lambda _, d, i: allowed})()


def test_a_sampled_draft_draws_from_the_shares_above_the_threshold_renormalised():
    counts = {5: 6, 6: 3, 7: 1, 8: 1, 9: 1}  # shares .5, .25 and three of 1/12, below MIN_TOKEN_PROB
    q = suffix.count_law(counts, None)
    assert dict(zip(q.ids.tolist(), q.probs.tolist())) == pytest.approx({5: 2 / 3, 6: 1 / 3})
    allowed = np.zeros(16, bool)
    allowed[[6, 7]] = True  # a constraint that forbids 5: what it allows of the rest, renormalised
    q = suffix.count_law(counts, allowed)
    assert q.ids.tolist() == [6] and q.probs.tolist() == [1.0]
    allowed[6] = False
    assert suffix.count_law(counts, allowed) is None  # nothing above the threshold allowed: no draft


def test_a_sampled_draft_follows_the_occurrences_of_what_it_drew_and_stops_only_before_a_draw():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 7, 9], [1, 2, 3, 4, 7, 9]]
    idx = SuffixIndex()
    for i, seq in enumerate(seqs):
        idx.extend(i, seq)
    at, match = idx.occurrences([0, 1, 2, 3, 4])
    assert match == 4 and len(at) == 4
    seen = {}
    for seed in range(400):
        drafts, dists = suffix.draw(at, match, 8, Law(seed))
        seen[tuple(drafts)] = seen.get(tuple(drafts), 0) + 1
        assert len(drafts) == len(dists) and all(abs(q.probs.sum() - 1) < 1e-12 for q in dists)
        if drafts[:1] == [7]:  # after 7, its three occurrences alone: 8 once, 9 twice
            assert dists[1].prob_of(9) == pytest.approx(2 / 3)
    # 5 (share 1/4) then 6, or 7 (3/4) then 8 or 9: every path the counts allow, about as often as they say
    assert set(seen) == {(5, 6), (7, 8), (7, 9)}
    assert 0.15 < seen[(5, 6)] / 400 < 0.35 and 0.4 < seen[(7, 9)] / 400 < 0.6
    assert suffix.draw(at, match, 1, Law())[0] in ([5], [7])  # at most n_max
    assert suffix.draw(at, 1, 8, Law())[0] in ([5], [7])  # at most MAX_SPEC_FACTOR × the match


def fixture_store(e: Engine, toks: list[int], law: dict) -> SuffixStore:
    """A store that continues each first token the target may sample (its top 4) with the two it finds least
    likely next, 3 : 2, and nine tokens once each (shares of 1/14, dropped by the threshold): q puts all its
    mass where p puts little, and the drop leaves 5/14 of the counts to renormalise."""
    store = SuffixStore()
    store.learning = False  # the store stays as built: every sample drafts from the same counts
    firsts: dict[int, list] = {}
    for (y, x), p in law.items():
        firsts.setdefault(y, []).append((p, x))
    rare = [t for t in range(100, 400) if all(t not in (x for _, x in v) for v in firsts.values())][:9]
    for y, opts in firsts.items():
        low, second = sorted(opts)[0][1], sorted(opts)[1][1]
        for child, n in [(low, 3), (second, 2), *((t, 1) for t in rare)]:
            for _ in range(n):
                store.add(toks[-suffix.PROMPT_TAIL:] + [y, child])
    return store


def store_q(store: SuffixStore, toks: list[int], y: int):
    """The store's count law (q) at the first drafted position, after the prompt and first token y."""
    at, _ = store.index.occurrences(toks + [y])
    return suffix.count_law(suffix.followers(at, 0), None)


def tv_to_target(store: SuffixStore, toks: list[int], law: dict) -> float:
    """The least total variation, over the first tokens, between q at the first drafted position and p."""
    worst = 1.0
    firsts = {y for y, _ in law}
    for y in firsts:
        q = store_q(store, toks, y)
        p_y = first_law(law)[y]
        p = {x: pr / p_y for (a, x), pr in law.items() if a == y}
        worst = min(worst, 0.5 * sum(abs(p.get(t, 0.0) - q.prob_of(t)) for t in set(p) | set(q.ids.tolist())))
    return worst


def test_sampled_suffix_drafts_keep_the_joint_law_of_the_first_tokens_at_temperature_1(tiny_target):
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0, drafter="suffix")
    with Engine(tiny_target, None, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        law = target_law(tiny_target, toks, 2, top_k=4)
        e.provided["suffix"] = store = fixture_store(e, toks, law)
        assert tv_to_target(store, toks, law) >= 0.3
        counts, stats = sampled_law(e, toks, 3000, 2, n_predict=3, draft_max=1, **kw)
    drafted = sum(st.n_drafted_store for st in stats)
    accepted = sum(st.n_accepted_store for st in stats)
    assert len(law) == 16 and drafted == 3000  # the second token was a sampled store draft in every run
    assert 300 < accepted < drafted - 300  # accepted often, rejected often: both branches of the rule ran
    assert chi2_pvalue(counts, law) > 0.001
    # Rejection sampling accepts a draft drawn from q with probability Σ min(p, q): the verify used the q the draft
    # was drawn from. (A point mass on the drawn token as q keeps the law too, any draw's does, but accepts
    # only Σ q·p: that mistake shows here, not in the law.)
    want = sum(p_y * accept_rate(store, toks, law, y) for y, p_y in first_law(law).items())
    assert abs(accepted - drafted * want) < 4 * (drafted * want * (1 - want)) ** 0.5, (accepted, drafted * want)


def first_law(law: dict) -> dict:
    out: dict[int, float] = {}
    for (y, _), p in law.items():
        out[y] = out.get(y, 0.0) + p
    return out


def accept_rate(store: SuffixStore, toks: list[int], law: dict, y: int) -> float:
    """Σ min(p, q) at the drafted position after first token y: p the target's law, q the store's count law."""
    q = store_q(store, toks, y)
    p_y = first_law(law)[y]
    return sum(min(pr / p_y, q.prob_of(x)) for (a, x), pr in law.items() if a == y)


# ---- through the server ------------------------------------------------------------------------------------
openai = pytest.importorskip("openai")

from serve_proc import ServerProc  # noqa: E402
from test_serve import chat, client  # noqa: E402

SYSTEM = "You answer in code. Tools: get_weather(city), get_time(zone). Reply with one call."


def ask(c, text: str, **kw):
    return c.chat.completions.create(model="target", temperature=0, max_tokens=48,
                                     messages=[{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": text}], **kw)


def serve(tiny_target, log, *extra) -> ServerProc:
    return ServerProc(["--target", str(tiny_target), "--parallel", "2", "--drafter", "suffix", "--draft-max", "8",
                       "--threads", "1", "--ctx", "512", *extra], log)


def test_a_server_drafts_the_second_round_from_the_first_and_keeps_its_store_in_a_file(tiny_target, tmp_path):
    """Two rounds of two concurrent requests sharing a system prompt: the second drafts from the first's answers
    (every answer its target-alone twin's); the store is written at exit, owner-only, and read by the next
    server, whose first round then drafts from it; a corrupt file is one warning line and an empty store."""
    cache = tmp_path / "answers.sfx"
    srv = serve(tiny_target, tmp_path / "one.log", "--suffix-cache", str(cache))
    users = ["weather in Paris", "time in Tokyo"]
    try:
        c = client(srv.url)
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda u: ask(c, u), users))
            second = list(pool.map(lambda u: ask(c, u), users))
        alone = [ask(c, u, extra_body={"draft_max": 0}) for u in users]
    finally:
        assert srv.stop() == 0
    for f, s, a in zip(first, second, alone):
        assert s.choices[0].message.content == a.choices[0].message.content == f.choices[0].message.content
        assert len(set(a.choices[0].message.content.split())) > 3
    spec = [r.usage.model_extra["speculative"] for r in second]
    assert all(x["n_drafted_store"] > 0 and x["n_accepted_store"] > 0 for x in spec), spec
    assert cache.is_file() and cache.stat().st_mode & 0o777 == 0o600

    srv = serve(tiny_target, tmp_path / "two.log", "--suffix-cache", str(cache))
    try:
        again = ask(client(srv.url), users[0])
        metrics = srv.metrics()
    finally:
        srv.stop()
    assert again.choices[0].message.content == alone[0].choices[0].message.content
    assert again.usage.model_extra["speculative"]["n_accepted_store"] > 0  # read from the file
    assert metrics['specq:suffix_accepted_tokens_total{source="store"}'] > 0

    cache.write_bytes(cache.read_bytes()[:-40])  # cut short
    srv = serve(tiny_target, tmp_path / "three.log", "--suffix-cache", str(cache))
    try:
        cold = ask(client(srv.url), users[0])
    finally:
        srv.stop()
    warned = [ln for ln in (tmp_path / "three.log").read_text().splitlines() if "--suffix-cache" in ln]
    assert len(warned) == 1 and "corrupt or truncated" in warned[0] and "Traceback" not in warned[0], warned
    assert cold.choices[0].message.content == alone[0].choices[0].message.content
    assert cold.usage.model_extra["speculative"].get("n_drafted_store", 0) == 0

"""`specq serve`'s Prometheus metrics, with llama-server's names where it has one, so its dashboards work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .api import Outcome


class ServerMetrics:
    """One registry per server (never the process-global one, so tests can start several)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        disable_created_metrics()  # the `_created` twin of every counter is noise for a single-process server
        r = self.registry = CollectorRegistry()
        # llama-server's names (tools/server/server.cpp) and its speculative-decoding counters
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time.", registry=r)
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed.",
                                        registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Predict process time.", registry=r)
        self.predicted_tps = Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                                   registry=r)
        self.processing = Gauge("llamacpp:requests_processing", "Number of requests processing.", registry=r)
        self.deferred = Gauge("llamacpp:requests_deferred", "Number of requests deferred (the queue depth).",
                              registry=r)
        self.draft_tokens = Counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens verified by the target.",
                                    registry=r)
        self.accepted_tokens = Counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       registry=r)
        self.drafts = Counter("llamacpp:spec_decode_num_drafts", "Steps that verified a draft.", registry=r)
        self.accepted_per_pos = Counter("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position of a draft (0 = the first).",
                                        ["position"], registry=r)
        # specq's own
        self.requests = Counter("specq:requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("specq:requests_cancelled", "Generations stopped because the client went away.",
                                 registry=r)
        self.rejected = Counter("specq:requests_rejected", "Requests refused with 503 because the queue was full.",
                                registry=r)
        self.prefix_reused = Counter("specq:prompt_tokens_reused",
                                     "Prompt tokens whose cache entries were kept from the previous request.",
                                     registry=r)
        # --parallel N: per sequence ("slot", llama-server's word)
        self.slots_busy = Gauge("specq:slots_busy", "Sequences running a request.", registry=r)
        self.slots_idle = Gauge("specq:slots_idle", "Sequences free for a request.", registry=r)
        self.slot_requests = Counter("specq:slot_requests", "Requests a sequence answered.", ["slot"], registry=r)
        self.slot_draft_tokens = Counter("specq:slot_spec_decode_num_draft_tokens",
                                         "Draft tokens verified by the target, per sequence.", ["slot"], registry=r)
        self.slot_accepted_tokens = Counter("specq:slot_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted, per sequence.", ["slot"], registry=r)
        self.prefix_copied = Counter("specq:prompt_tokens_copied", "Prompt tokens copied from another sequence's "
                                     "cache (a shared prefix, llama_memory_seq_cp) instead of evaluated.", registry=r)
        self.prefill_chunks = Counter("specq:prefill_chunks", "Prompt chunks evaluated between two steps of the "
                                      "running sequences (a long prompt joining).", registry=r)
        self.multi_verifies = Gauge("specq:verify_decodes_multi",
                                    "Target decodes that verified two or more sequences at once.", registry=r)
        self.decodes = Gauge("specq:decodes", "llama_decode calls since the server started (its warm-up not "
                             "counted), by model: target or draft; each evaluates one batch of rows.", ["model"],
                             registry=r)
        self.decode_seconds = Gauge("specq:decode_seconds", "Time inside those llama_decode calls, by model.",
                                    ["model"], registry=r)
        self.batch_steps = Gauge("specq:batch_steps", "Batched steps of two or more sequences, by what the batch's "
                                 "planner did: planned (all), plain (no drafting where some sequence wished it), "
                                 "capped (a draft shortened), probes (one token drafted to keep the estimates "
                                 "current), refused (a probe not run: over its budget).", ["kind"], registry=r)
        self.suffix_drafted = Counter("specq:suffix_draft_tokens", "--drafter suffix: tokens it proposed, by "
                                      "source: store (earlier answers) or text (the request's own).", ["source"],
                                      registry=r)
        self.suffix_accepted = Counter("specq:suffix_accepted_tokens", "--drafter suffix: its tokens accepted, by "
                                       "source.", ["source"], registry=r)
        self.vocab_overlap = Gauge("specq:draft_vocab_overlap", "A draft of another vocabulary: the share of its "
                                   "probability mass on tokens both vocabularies share (a calibration text), by the "
                                   "translation it runs (--vocab-map: tli, string or auto).", ["vocab_map"],
                                   registry=r)
        self.vocab_steps = Gauge("specq:draft_vocab_steps", "--vocab-map auto: the steps each translation (tli, "
                                 "string) has drafted, all requests.", ["vocab_map"], registry=r)
        self._gen_tokens = 0
        self._gen_seconds = 0.0

    def slots(self, total: int, busy: int, multi_verifies: int = 0) -> None:
        self.slots_busy.set(busy)
        self.slots_idle.set(total - busy)
        self.multi_verifies.set(multi_verifies)

    def contexts(self, engine) -> None:
        """The engine's llama_decode counts and times, for the target and (where it has one) the draft model."""
        for name, ctx in (("target", engine.tgt_ctx), ("draft", engine.dft_ctx)):
            if ctx is not None:
                self.decodes.labels(model=name).set(ctx.n_decode_calls)
                self.decode_seconds.labels(model=name).set(ctx.decode_s)
        if engine.vocab_overlap is not None:
            self.vocab_overlap.labels(vocab_map=engine.vocab_map).set(engine.vocab_overlap)
        if engine.vocab_chooser is not None:
            for t, n in engine.vocab_chooser.steps.items():
                self.vocab_steps.labels(vocab_map=t).set(n)

    def batch(self, planner) -> None:
        """The parallel batch's planner counters (control/batch_plan.BatchPlanner)."""
        for kind, n in (("planned", planner.n_steps), ("plain", planner.n_plain), ("capped", planner.n_capped),
                        ("probes", planner.n_probes), ("refused", planner.n_refused)):
            self.batch_steps.labels(kind=kind).set(n)

    def observe(self, o: Outcome, slot: int | None = None) -> None:
        """Count one finished (or cancelled) generation (on sequence `slot` with --parallel)."""
        if slot is not None:
            self.slot_requests.labels(slot=str(slot)).inc()
            if o.stats is not None and o.stats.speculative:
                self.slot_draft_tokens.labels(slot=str(slot)).inc(o.stats.n_drafted)
                self.slot_accepted_tokens.labels(slot=str(slot)).inc(o.stats.n_accepted)
        self.prompt_tokens.inc(o.n_prompt)
        self.prefix_reused.inc(o.n_reused)
        st = o.stats
        if st is None:
            return
        self.prompt_seconds.inc(st.prompt_ms / 1e3)
        self.tokens_predicted.inc(st.n_generated)
        self.predicted_seconds.inc(st.gen_ms / 1e3)
        self._gen_tokens += st.n_generated
        self._gen_seconds += st.gen_ms / 1e3
        if self._gen_seconds > 0:
            self.predicted_tps.set(self._gen_tokens / self._gen_seconds)
        if st.speculative:
            self.draft_tokens.inc(st.n_drafted)
            self.accepted_tokens.inc(st.n_accepted)
            self.drafts.inc(sum(n for k, n in st.steps_by_k if k > 0))
            for pos, n in enumerate(st.accepted_per_pos):
                if n:
                    self.accepted_per_pos.labels(position=str(pos)).inc(n)
            for source, drafted, accepted in (("store", st.n_drafted_store, st.n_accepted_store),
                                              ("text", st.n_drafted_text, st.n_accepted_text)):
                if drafted:
                    self.suffix_drafted.labels(source=source).inc(drafted)
                    self.suffix_accepted.labels(source=source).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""specq's public Python API, imported from `specq` itself (`specq.load`, `specq.Pair`, ...; docs/python-api.md).
Everything else under `specq.native` is internal and may move.

A `Pair` is a loaded target (and draft, where one is given) on this machine: `generate` returns a `Result`,
`stream` yields `TokenEvent`s, `generate_batch` runs several prompts as one batch of sequences, `tokenize` and
`apply_chat_template` prepare prompts, and `json_schema=` constrains an answer exactly. Greedy output is the
target's own whatever drafts; sampled output follows the target's distribution.

Threads: llama.cpp computes on an OpenMP thread team that belongs to the thread that loaded the models (driven
from another thread it decodes slower: docs/benchmarks.md, "The engine driven from another thread"). A Pair
therefore computes only on the thread that loaded it: a call from another thread raises `specq.WrongThreadError`,
naming both threads.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Iterator

from ..errors import SpecqError, UsageError
from ..machine import cache_dir
from .core.constraint import Constraint, compile_constraint
from .core.settings import GenerationSettings
from .core.stats import GenerationStats, TokenEvent
from .core.template import TemplateFormatter, load_template
from .drafters.registry import engine_options, parse_drafter, speculates
from .runtime.batch import Batch
from .runtime.config import EngineConfig
from .runtime.engine import Engine
from .runtime.generation import Generation

__all__ = ["Pair", "Result", "Stream", "TokenEvent", "GenerationStats", "SpecqError", "WrongThreadError", "load"]

DEMO = "demo"  # load(DEMO): the built-in demo pair (SmolLM2-135M-Instruct's F32 target, its Q4_1 draft)
PRESETS_DIR = "pairs"  # load(PRESET): the converted pair in cache_dir()/PRESETS_DIR/PRESET


class WrongThreadError(UsageError):
    """A Pair was called from another thread than the one that loaded it."""


@dataclass(frozen=True)
class Result:
    """A finished generation: its text, its token ids and its stats (n_drafted, n_accepted, tokens_per_s, ...)."""

    text: str
    tokens: list[int]
    stats: GenerationStats


class Stream:
    """The tokens of one generation as they come (`TokenEvent`: token, text, from_draft, step); `result` once the
    iteration has ended (also when it was stopped early)."""

    def __init__(self, gen: Generation):
        self._gen = gen
        self.result: Result | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        try:
            yield from self._gen
        finally:
            g = self._gen
            self.result = Result(g.text, list(g.tokens), g.stats)


def load(target: str | Path | None = None, draft: str | Path | None = None, *, ctx: int | None = None,
         threads: int | None = None, parallel: int = 1, drafter: str | None = None,
         draft_max: int | str | None = None, ngl: int = 0, ngl_draft: int | None = None,
         flash_attn: str = "auto", template: str | None = None) -> Pair:
    """Open a pair on this thread: `target` a GGUF file (with `draft` a GGUF file or none), a pair folder written by
    `specq convert` (its manifest's files and suggested settings), a preset's name (its pair converted into the
    cache folder: preset_folder), or "demo" / None for the built-in demo pair.
    `ctx`: tokens of context per sequence (default: the pair folder's suggestion, else EngineConfig's);
    `parallel`: sequences generate_batch runs at once; `drafter`: model, ngram, suffix, mtp, a comma list or auto
    (default: model where a draft is loaded, else ngram); `draft_max`: a number or "auto" (default: the manifest's,
    else GenerationSettings');
    `ngl`/`ngl_draft`: layers on a GPU (0: the CPU); `template`: a chat template (file or text) instead of the
    target's own."""
    suggested: dict = {}
    if target is None or str(target) == DEMO:
        if draft is not None:
            raise UsageError("a draft needs its target; give both files, or neither for the demo pair")
        from .commands.demo import demo_pair

        target, draft = demo_pair()
    else:
        target = preset_folder(str(target)) or target
        if Path(target).is_dir():
            from ..manifest import load_pair

            p = load_pair(Path(target))
            target, draft, suggested = p.target_path, draft or p.draft_path, dict(p.settings)
        elif not Path(target).exists():
            raise UsageError(f"no such model file, pair folder or preset: {target} (`specq presets` lists the "
                             "presets)")
    drafter = drafter or suggested.get("drafter") or ("model" if draft else "ngram")
    drafters = parse_drafter(drafter)
    if draft is None and "model" in drafters:
        raise UsageError(f"drafter {drafter!r} needs a draft model; pass draft=, or drafter='ngram'")
    # a value not given: the pair's suggestion, else the settings' and the engine's own default
    draft_max = draft_max if draft_max is not None else suggested.get("draft_max")
    settings = GenerationSettings(drafter=drafter, **({} if draft_max is None else {"draft_max": draft_max}))
    ctx = ctx or suggested.get("ctx")
    cfg = EngineConfig(target=str(target), draft=str(draft) if draft else None, **({"ctx": ctx} if ctx else {}),
                       threads=threads, ngl=ngl, ngl_draft=ngl if ngl_draft is None else ngl_draft,
                       flash_attn=flash_attn, parallel=parallel, **engine_options(drafters))
    return Pair(cfg.open(), settings.validate(), template)


def preset_folder(name: str) -> Path | None:
    """Where load(NAME) finds a preset's pair: PRESETS_DIR/NAME under the cache folder, written by `specq convert
    --preset NAME --out` there (a preset not converted yet is one error that says so). None: not a preset name."""
    if Path(name).exists() or not (resources.files("specq.models") / f"{name}.toml").is_file():
        return None
    folder = cache_dir() / PRESETS_DIR / name
    if not folder.is_dir():
        raise UsageError(f"preset {name} is not converted yet: run `specq convert --preset {name} --out {folder}` "
                         f"once (it downloads the checkpoints), then load({name!r})")
    return folder


class Pair:
    """A loaded target and draft (or the target alone with a drafter that needs no model). Use it as a context
    manager, or close() it: the models' memory is freed then."""

    def __init__(self, engine: Engine, defaults: GenerationSettings, template: str | None = None):
        self._engine = engine
        self.defaults = defaults
        self._template = template
        self._formatter: TemplateFormatter | None = None
        self._thread = threading.current_thread()
        self._sessions = [engine.session(i) for i in range(engine.parallel)]

    # ---- prompts ----------------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """The target's token ids for `text` (its BOS first where the model adds one, with `special`)."""
        return self._engine.target.tokenize(text, add_special=special, parse_special=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self._engine.target.detokenize(tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation ([{"role": ..., "content": ...}]), through the target's chat
        template (or load's `template`), ending where the assistant's answer begins."""
        if self._formatter is None:
            tgt = self._engine.target
            self._formatter = TemplateFormatter.for_model(
                load_template(self._template, tgt.chat_template(), str(tgt.path)), tgt)
        return self._formatter.render(messages, tools)

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], **options) -> Result:
        """Generate to the end (the options: docs/python-api.md, or `_settings`)."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list[int], **options) -> Stream:
        """Generate token by token: iterate the returned Stream for TokenEvents; its `result` after."""
        self._check_thread()
        s, speculative = self._settings(**options)
        ses = self._sessions[0]
        ses.reset()
        return Stream(ses.generate(self._tokens(prompt), s, speculative))

    def generate_batch(self, prompts: list[str | list[int]], **options) -> list[Result]:
        """Several prompts as one batch of sequences (each step verifies every sequence's drafts in one target
        decode), `parallel` of them at once (load's); the results in the prompts' order."""
        self._check_thread()
        s, speculative = self._settings(**options)
        todo = [self._tokens(p) for p in prompts]
        out: list[Result] = []
        n = self._engine.parallel
        for first in range(0, len(todo), n):
            batch, gens = Batch(), []
            for ses, toks in zip(self._sessions, todo[first:first + n]):
                ses.reset()
                gens.append(ses.generate(toks, s, speculative))
            failed = batch.add_all(gens)
            if failed:
                raise failed[0][1]
            batch.run()
            out += [Result(g.text, list(g.tokens), g.stats) for g in gens]
        return out

    def _settings(self, max_tokens: int | None = 256, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, min_p: float | None = None, seed: int | None = None,
                  draft_max: int | str | None = None, drafter: str | None = None,
                  json_schema: dict | str | None = None, speculative: bool = True) -> tuple[GenerationSettings, bool]:
        """The generation options: `max_tokens` (None: to the end of generation or a full context), sampling
        (`temperature` 0, the default, is greedy; each option not given is GenerationSettings'), `draft_max` and
        `drafter` (load's by default), `json_schema` (the answer is JSON that the schema accepts), `speculative`
        False for the target alone. → (settings, speculative)."""
        given = {"temp": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                 "draft_max": draft_max, "drafter": drafter}
        s = replace(self.defaults, n_predict=max_tokens, **{k: v for k, v in given.items() if v is not None})
        if json_schema is not None:
            text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
            s = replace(s, constraint=compile_constraint(self._engine.target, Constraint("json_schema", text)))
        s = s.validate()
        return s, speculative and speculates(self._engine, s.drafters)

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def _check_thread(self) -> None:
        now = threading.current_thread()
        if now is not self._thread:
            raise WrongThreadError(f"this Pair was loaded on thread {self._thread.name!r} and computes only there "
                                   f"(called from {now.name!r}); load it on the thread that generates")

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

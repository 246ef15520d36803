"""What every command shares: -v/-q, logging, and turning specq exceptions into one line and an exit code."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from ..errors import ManifestError, SpecqError, UsageError
from ..native.runtime.config import EngineConfig
from ..native.core.settings import GenerationSettings
from .checks import check_finite, user_path

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log and specq's debug log.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only results.")]

# Results go to stdout; tables, progress and messages to stderr unless a command says otherwise.
# markup off: strings we print carry user text (paths, prompts) whose "[...]" Rich would eat.
out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, markup=False)


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """llama.cpp's log (logger specq.llama) and debug output appear only with --verbose."""
    root = logging.getLogger("specq")
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root.addHandler(handler)
    root.propagate = False
    if verbose:
        root.setLevel(logging.DEBUG)
        logging.getLogger("specq.llama").setLevel(logging.DEBUG)
    else:
        root.setLevel(logging.ERROR if quiet else logging.WARNING)
        logging.getLogger("specq.llama").setLevel(logging.CRITICAL + 1)


def fail(message: str, code: int = 1) -> None:
    """Print exactly one line on stderr and exit."""
    print(f"specq: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def warn(message: str | None, quiet: bool = False) -> None:
    """One warning line on stderr (not with --quiet): the run goes on."""
    if message and not quiet:
        print(f"specq: warning: {message}", file=sys.stderr, flush=True)


def handle_errors(fn: Callable) -> Callable:
    """Run a command body: SpecqError → one line + its exit code; Ctrl-C → 130; full disk → 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except SpecqError as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            print("specq: interrupted", file=sys.stderr, flush=True)
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader went away (`specq plan | head`): not an error worth a message.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0)
        except OSError as e:
            where = user_path(e.filename2 or e.filename) if e.errno == errno.EISDIR else user_path(e.filename)
            if e.errno == errno.ENOSPC:
                fail(f"no space left on the device ({where or 'output'}); free some disk space and retry")
            fail(f"{e.strerror or e} ({where}); check the path and permissions")

    return wrapper


# -- options shared by the commands that run models (bench, chat, tune) ------------------------------
PairOpt = Annotated[Optional[Path], typer.Option("--pair", help="A pair folder from `specq convert` (its specq-pair.toml).")]
TargetOpt = Annotated[Optional[Path], typer.Option("--target", help="Target GGUF (default: the built-in demo pair).")]
DraftOpt = Annotated[Optional[Path], typer.Option("--draft", help="Draft GGUF, vocabulary-compatible with the target.")]
DraftMaxOpt = Annotated[str, typer.Option("--draft-max", help="Most tokens drafted per step, or auto (adaptive, "
                                                              "drafts nothing when drafting does not pay).")]
DraftMinOpt = Annotated[int, typer.Option("--draft-min", help="Drafts shorter than this are dropped.")]
PMinOpt = Annotated[float, typer.Option("--p-min", help="Stop drafting when the draft's top-1 probability is below this.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k (temp > 0).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (temp > 0).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p (temp > 0).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
AcceptOpt = Annotated[str, typer.Option("--accept", help="Verification at temp > 0: rejection (exact rejection "
                                                         "sampling, accepts more), match (llama.cpp's rule) or auto "
                                                         "(= rejection). Temp 0 is greedy either way.")]
CtxOpt = Annotated[int, typer.Option("--ctx", help="Context size (tokens) for both models.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: physical cores).")]
CtxDraftOpt = Annotated[str, typer.Option("--ctx-draft", help="The draft's context size: smaller than --ctx, "
                                                           "the draft sees only that many recent tokens, which "
                                                           "keeps it cheap at long context; 0: the whole context; "
                                                           "auto (default): the whole context, or a 512-token "
                                                           "window where one is measured to be faster (greedy, "
                                                           "--draft-max auto, from 1,536 tokens of context).")]
ThreadsDraftOpt = Annotated[Optional[int], typer.Option("--threads-draft", help="The draft's CPU threads "
                                                                              "(default: --threads).")]
NglOpt = Annotated[Optional[int], typer.Option("--ngl", help="Target layers on the GPU (default: all when a GPU "
                                                             "is present; an explicit value wins over --vram-budget).")]
NglDraftOpt = Annotated[Optional[int], typer.Option("--ngl-draft", help="Draft layers on the GPU (default: all "
                                                                        "when a GPU is present).")]
VramBudgetOpt = Annotated[Optional[str], typer.Option("--vram-budget", help="Plan GPU layers for both models within "
                                                                            "a budget: a fraction of free memory "
                                                                            "(0.9) or a size (22GiB, or 24GiB,24GiB).")]
MainGpuOpt = Annotated[int, typer.Option("--main-gpu", help="The GPU for the whole model when not split.")]
TensorSplitOpt = Annotated[Optional[str], typer.Option("--tensor-split", help="Share of layers per GPU, e.g. 3,1.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="ggml devices for the target, e.g. CUDA0 "
                                                                   "(see `specq doctor`).")]
CpuAmxOpt = Annotated[bool, typer.Option("--cpu-amx", help="Let llama.cpp use its AMX weight buffer on Intel CPUs "
                                                          "with AMX (off by default: it crashes, llama.cpp#20824).")]
FlashAttnOpt = Annotated[str, typer.Option("--flash-attn", help="Attention path: on, off or auto (off for a model "
                                                               "on the CPU, where it decodes faster at long "
                                                               "context; with --parallel on the CPU measured on "
                                                               "this machine once; llama.cpp's choice on a GPU).")]
DrafterOpt = Annotated[str, typer.Option("--drafter", help="Who proposes tokens: model (the draft model), ngram "
                                                          "(lookup in the text so far, no model), suffix (what "
                                                          "followed in earlier answers or this text), mtp (the "
                                                          "target's own MTP head), a comma list such as "
                                                          "model,ngram (the n-gram's proposal where the text repeats, "
                                                          "else the model's), or auto (chosen each step from what was "
                                                          "measured, plain decoding included).")]
NgramMinOpt = Annotated[int, typer.Option("--ngram-min", help="Shortest repeated ending an n-gram proposal needs.")]
NgramMaxOpt = Annotated[int, typer.Option("--ngram-max", help="Longest ending the n-gram lookup tries first.")]
DraftDeviceOpt = Annotated[Optional[str], typer.Option("--draft-device", help="ggml devices for the draft.")]
RpcOpt = Annotated[Optional[str], typer.Option("--rpc", help="RPC servers HOST:PORT[,HOST:PORT...] (`specq rpc-server` "
                                                            "on each): the target spreads over their devices (RPC0, "
                                                            "RPC1, ...) and the local GPUs; the draft stays local.")]
SuffixCacheOpt = Annotated[Optional[Path], typer.Option("--suffix-cache", help="File the suffix drafter's store of "
                                                        "earlier answers is read from at start and written back "
                                                        "to (atomically, owner-only) every few minutes and at exit "
                                                        "(default: the store lives as long as the process).")]
SuffixScopeOpt = Annotated[str, typer.Option("--suffix-scope", help="server: one store of earlier answers for every "
                                                                 "sequence and request; request: none, each request "
                                                                 "drafts from its own text alone (a server shared "
                                                                 "between users).")]

VocabMapOpt = Annotated[str, typer.Option("--vocab-map", help="How a draft of another vocabulary proposes target "
                                                          "tokens: tli (its distribution over the tokens both share), "
                                                          "string (its text re-tokenized by the target) or auto.")]


# -- the one group: each shared flag's annotation and default, stated here alone ----------------------------
# A default that means what the library's does is read from it (GenerationSettings, EngineConfig); the CLI's own
# differ on purpose: --draft-max auto (the library drafts 8), --ngl unset (all layers on a GPU where there is one).
_GEN, _ENG = GenerationSettings, EngineConfig
SHARED_FLAGS: dict[str, tuple] = {
    "pair": (PairOpt, None), "target": (TargetOpt, None), "draft": (DraftOpt, None),
    # generation
    "draft_max": (DraftMaxOpt, "auto"), "draft_min": (DraftMinOpt, _GEN.draft_min), "p_min": (PMinOpt, _GEN.p_min),
    "temp": (TempOpt, _GEN.temp), "top_k": (TopKOpt, _GEN.top_k), "top_p": (TopPOpt, _GEN.top_p),
    "min_p": (MinPOpt, _GEN.min_p), "seed": (SeedOpt, _GEN.seed), "accept": (AcceptOpt, _GEN.accept),
    "drafter": (DrafterOpt, _GEN.drafter), "ngram_min": (NgramMinOpt, _GEN.ngram_min),
    "ngram_max": (NgramMaxOpt, _GEN.ngram_max),
    # the engine
    "ctx": (CtxOpt, _ENG.ctx), "threads": (ThreadsOpt, _ENG.threads), "ctx_draft": (CtxDraftOpt, _ENG.draft_ctx),
    "threads_draft": (ThreadsDraftOpt, _ENG.draft_threads), "ngl": (NglOpt, None), "ngl_draft": (NglDraftOpt, None),
    "vram_budget": (VramBudgetOpt, None), "main_gpu": (MainGpuOpt, _ENG.main_gpu),
    "tensor_split": (TensorSplitOpt, None), "device": (DeviceOpt, None), "draft_device": (DraftDeviceOpt, None),
    "rpc": (RpcOpt, None), "cpu_amx": (CpuAmxOpt, _ENG.cpu_amx), "flash_attn": (FlashAttnOpt, _ENG.flash_attn),
    "suffix_cache": (SuffixCacheOpt, _ENG.suffix_cache), "suffix_scope": (SuffixScopeOpt, _ENG.suffix_scope),
    "vocab_map": (VocabMapOpt, _ENG.vocab_map),
}
GENERATION_FLAGS = ("draft_max", "draft_min", "p_min", "temp", "top_k", "top_p", "min_p", "seed", "accept",
                    "drafter", "ngram_min", "ngram_max")
PLACEMENT_FLAGS = ("threads", "ngl", "ngl_draft", "vram_budget", "main_gpu", "tensor_split", "device",
                   "draft_device", "rpc", "cpu_amx", "flash_attn")
ENGINE_FLAGS = ("ctx", "ctx_draft", "threads_draft") + PLACEMENT_FLAGS + ("suffix_cache", "suffix_scope", "vocab_map")


class Flags:
    """The shared flags a command was given (`shared_flags`), as attributes; one it does not take reads as the
    group's default."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __getattr__(self, name: str):
        if name not in SHARED_FLAGS:
            raise AttributeError(name)
        return SHARED_FLAGS[name][1]


def shared_flags(*names: str):
    """Give a command these flags of SHARED_FLAGS (annotation and default from there), after its own parameters
    and before -v/-q; the command receives them as one `flags: Flags`. A flag the command declares itself (its own
    meaning or default, as tune's --draft-max) is its own and is not added."""
    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "flags"]
        added = [n for n in names if n not in sig.parameters]
        tail = [p for p in own if p.name in ("verbose", "quiet")]
        params = [p for p in own if p not in tail] + [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=SHARED_FLAGS[n][0],
                              default=SHARED_FLAGS[n][1]) for n in added] + tail

        @functools.wraps(fn)
        def command(*args, **kwargs):
            return fn(*args, flags=Flags({n: kwargs.pop(n) for n in added}), **kwargs)

        command.__signature__ = sig.replace(parameters=params)
        command.shared_flags = tuple(added)  # (tests/test_cli_flags.py)
        del command.__wrapped__  # typer reads __signature__, not the wrapped function's
        return command
    return decorate


def _number_or_auto(flag: str, value: str | int) -> int | str:
    if isinstance(value, int) or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{flag} must be a number or auto ({value})")


def parse_draft_max(value: str | int) -> int | str:
    """--draft-max N or auto."""
    return _number_or_auto("--draft-max", value)


def parse_ctx_draft(value: str | int) -> int | str:
    """--ctx-draft N or auto."""
    return _number_or_auto("--ctx-draft", value)


PAIR_SETTINGS = ("draft_max", "draft_min", "p_min", "ctx", "drafter")  # what a pair manifest may suggest


def resolve_pair(pair: Path | None, target: Path | None, draft: Path | None, click_ctx) -> tuple:
    """--pair DIR → (target, draft, suggested settings not overridden on the command line);
    the manifest's [tuned] (from `specq tune --write`) wins over its [settings]."""
    if pair is None:
        return target, draft, {}
    if target is not None or draft is not None:
        raise UsageError("give --pair or --target/--draft, not both")
    from ..manifest import load_pair

    p = load_pair(pair)
    tuned = p.manifest.get("tuned")
    suggested = {**p.settings, **(tuned if isinstance(tuned, dict) else {})}
    # typer may vendor its own click, so compare the source by name
    keep = {k: suggested[k] for k in PAIR_SETTINGS if k in suggested
            and getattr(click_ctx.get_parameter_source(k), "name", "") != "COMMANDLINE"}
    check_manifest_settings(keep, p.dir)
    return p.target_path, p.draft_path, keep


_MANIFEST_TYPES = {"draft_max": (int, str), "draft_min": (int,), "p_min": (int, float), "ctx": (int,),
                   "drafter": (str,)}


def check_manifest_settings(settings: dict, pair_dir: Path) -> None:
    """A bad value in the manifest is the manifest's fault (exit 1, naming it and the key), not a bad flag."""
    from ..manifest import MANIFEST_NAME

    where = pair_dir / MANIFEST_NAME
    for key, value in settings.items():
        ok = isinstance(value, _MANIFEST_TYPES[key]) and not isinstance(value, bool)
        try:
            if ok and key == "ctx":
                ok = value >= 16
            elif ok:
                GenerationSettings(**{key: parse_draft_max(value) if key == "draft_max" else value}).validate()
                if key == "drafter":
                    from ..native.drafters.registry import parse_drafter

                    parse_drafter(value)
        except UsageError:
            ok = False
        if not ok:
            raise ManifestError(f"bad {key} in the pair manifest ({where}: {key} = {value!r}); fix or remove "
                                "that line, or re-run `specq convert --force`")


def models_or_demo(target: Path | None, draft: Path | None) -> tuple:
    """(target, draft) as given, or the built-in demo pair when neither is."""
    if target is not None:
        return target, draft
    if draft is not None:
        raise UsageError("--draft needs --target; omit both for the demo pair")
    from ..native.commands.demo import demo_pair

    return demo_pair()


def draft_for_drafters(settings: GenerationSettings, draft: Path | None) -> Path | None:
    """The draft model to load for --drafter: none for n-gram lookup alone; a comma list with `model` needs one."""
    if "model" in settings.drafters and draft is None and settings.drafter != "model":
        raise UsageError(f"--drafter {settings.drafter} needs a --draft model; use --drafter ngram without one")
    return draft if "model" in settings.drafters or settings.drafters == ("auto",) else None


def engine_config(target: Path, draft: Path | None, settings: GenerationSettings, flags: Flags, *, ctx: int,
                  parallel: int = 1) -> EngineConfig:
    """The model-loading flags → the one EngineConfig a command hands down: the placement resolved (planner,
    --rpc probed), and the target's MTP head where the drafters need it."""
    from ..native.commands.placement import resolve_placement
    from ..native.drafters.registry import engine_options

    f = flags
    if f.suffix_scope not in ("server", "request"):
        raise UsageError(f"--suffix-scope must be server or request ({f.suffix_scope})")
    if f.suffix_cache is not None and not Path(f.suffix_cache).parent.is_dir():
        raise UsageError(f"--suffix-cache: folder not found ({Path(f.suffix_cache).parent}); create it first")
    tgt, dft = str(target), str(draft) if draft else None
    p = resolve_placement(tgt, dft, ctx=ctx, ngl=f.ngl, ngl_draft=f.ngl_draft, vram_budget=f.vram_budget,
                          main_gpu=f.main_gpu, tensor_split=f.tensor_split, device=f.device,
                          draft_device=f.draft_device, cpu_amx=f.cpu_amx, flash_attn=f.flash_attn, rpc=f.rpc,
                          parallel=parallel)
    return EngineConfig(target=tgt, draft=dft, ctx=ctx, threads=f.threads, ngl=p.ngl, ngl_draft=p.ngl_draft,
                        main_gpu=p.main_gpu, tensor_split=p.tensor_split, draft_tensor_split=p.draft_tensor_split,
                        devices=p.devices, draft_devices=p.draft_devices, draft_ctx=parse_ctx_draft(f.ctx_draft),
                        draft_threads=f.threads_draft, cpu_amx=p.cpu_amx, flash_attn=p.flash_attn,
                        draft_flash_attn=p.draft_flash_attn, parallel=parallel,
                        suffix_cache=None if f.suffix_cache is None else str(f.suffix_cache),
                        suffix_scope=f.suffix_scope, vocab_map=f.vocab_map, **engine_options(settings.drafters))


def settings_from_flags(suggested: dict, flags: Flags, *, n_predict: int | None, **own) -> GenerationSettings:
    """The generation settings from the shared flags (a command's `own` values, such as serve's seed, instead of
    theirs), with a pair manifest's suggestions where a flag was not given."""
    from ..native.drafters.registry import parse_drafter

    v = {n: getattr(flags, n) for n in GENERATION_FLAGS} | own
    check_finite(temp=v["temp"], p_min=v["p_min"], top_p=v["top_p"], min_p=v["min_p"])
    drafter = suggested.get("drafter", v["drafter"])
    parse_drafter(drafter)  # a bad --drafter fails here, before a model loads (Session.generate orders the names)
    return GenerationSettings(
        n_predict=n_predict, draft_max=parse_draft_max(suggested.get("draft_max", v["draft_max"])),
        draft_min=suggested.get("draft_min", v["draft_min"]), p_min=suggested.get("p_min", v["p_min"]),
        temp=v["temp"], top_k=v["top_k"], top_p=v["top_p"], min_p=v["min_p"], seed=v["seed"], accept=v["accept"],
        drafter=drafter, ngram_min=v["ngram_min"], ngram_max=v["ngram_max"]).validate()

"""Shared plumbing for experiments and benchmarks: CLI, environment record, result writing.

Each experiment file holds only what makes it different; everything it shares with the
others (the config-to-CLI mapping, the results folder layout, the Markdown table, the
environment record) lives here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Versions, devices and machine facts recorded with every result."""
    import jax

    versions = {}
    for mod in ("jax", "jaxlib", "optax", "flax", "orbax.checkpoint", "grain", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions[mod] = getattr(m, "__version__", "?")
        except ImportError:
            versions[mod] = None
    devs = jax.devices()
    return {
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / jax arrays and scalars
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/Inf; keep them readable
    return x


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Renders dict rows as a GitHub Markdown table (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(
    out: pathlib.Path | str,
    *,
    config: Any,
    results: dict[str, Any],
    table: str,
    title: str,
    stem: str = "results",
) -> pathlib.Path:
    """Writes ``<stem>.json`` (config, environment, every number) and ``<stem>.md``.

    Files are written to a temporary name and renamed, so a reader never sees half a file.
    In a multi-process run only process 0 writes (every process holds the same numbers).
    """
    out = pathlib.Path(out)
    if not is_primary():
        return out
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": _jsonable(config),
        "environment": environment(),
        "results": _jsonable(results),
    }
    for name, text in (
        (f"{stem}.json", json.dumps(payload, indent=1, sort_keys=True) + "\n"),
        (f"{stem}.md", f"# {title}\n\n{table}"),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return out


def _field_type(f: dataclasses.Field, hints: dict[str, Any]) -> Any:
    t = hints.get(f.name, str)
    origin = typing.get_origin(t)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if args else str
    return t


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None``: config fields default to ``None`` on the command
    line (unset, so ``--quick`` can fill them) and state their real default in their help."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_config(cls: type, argv: Sequence[str] | None, description: str, *, name: str):
    """Builds an argparse CLI from a frozen dataclass; returns (config, args).

    Every field becomes ``--field-name`` with its default shown in ``--help``. ``--quick``
    starts from ``cls.quick()`` instead of the defaults; ``--out`` picks the results folder
    (default ``experiments/results/<name>``).
    """
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny smoke-run configuration")
    p.add_argument("--out", default=str(RESULTS / name), help="results folder")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g = p.add_argument_group(
        "multi-process runs",
        "Start one process per host (or several on one host) with the same command and "
        "these three flags; each process uses its local devices and process 0 writes the "
        "results. On a TPU pod slice, SLURM or Open MPI, --distributed finds them by itself.",
    )
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="HOST:PORT of process 0, where the processes meet (jax.distributed.initialize)",
    )
    g.add_argument("--num-processes", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", type=int, default=None, help="this process's index")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with the cluster's own detection "
        "(also when JAX_COORDINATOR_ADDRESS or STABLJAX_DISTRIBUTED is set)",
    )
    for f in dataclasses.fields(cls):
        t = _field_type(f, hints)
        kwargs: dict[str, Any] = {"type": t}
        if t is bool:
            kwargs["type"] = _parse_bool
        elif typing.get_origin(t) is tuple:
            kwargs = {"type": (typing.get_args(t) or (str,))[0], "nargs": "+"}
        helptext = f.metadata.get("help", f.name.replace("_", " "))
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, default=None, help=f"{helptext} (default {f.default})", **kwargs)
    args = p.parse_args(argv)
    base = cls.quick() if args.quick and hasattr(cls, "quick") else cls()
    changes = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name)
        if v is not None:
            changes[f.name] = tuple(v) if isinstance(v, list) else v
    return dataclasses.replace(base, **changes), args


# --------------------------------------------------------------------------------------
# Training plumbing shared by every experiment: model, data, optimizer, loop.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """Model, data and optimizer of one training run (the Wortsman et al. proxy setup).

    Pre-LN decoder, AdamW (0.9, 0.95), eps 1e-8, clip 1.0, linear warmup then cosine decay
    to 0, byte-level LM on the embedded corpus (:func:`stabljax.default_corpus`).
    """

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    norm: str = "layernorm"
    qk_norm: bool = False
    init_scheme: str = "gpt2"
    lr: float = 3e-3
    warmup_frac: float = 0.05
    steps: int = 300
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 1e-4
    clip: float = 1.0
    z_loss: float = 0.0
    precision: str = "fp32"
    seed: int = 0
    corpus_bytes: int = 2_000_000
    corpus: str | None = None
    eval_batches: int = 8


def init_distributed(args: argparse.Namespace | None = None) -> None:
    """Joins a multi-process run when launched as one; a single process needs nothing.

    With ``--coordinator-address``, ``--num-processes`` and ``--process-id`` (all three,
    from :func:`parse_config`) it calls ``jax.distributed.initialize`` with them. With
    ``--distributed``, or ``JAX_COORDINATOR_ADDRESS`` / ``STABLJAX_DISTRIBUTED`` in the
    environment, it calls it without arguments, and JAX finds its peers itself (TPU pod
    slices, SLURM, Open MPI, Kubernetes). On CPU the collectives between processes go
    through gloo. Must run before anything touches a JAX device.
    """
    import jax

    explicit = {
        k: getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id")
    }
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = sorted(set(explicit) - set(given))
        raise ValueError(
            "--coordinator-address, --num-processes and --process-id go together; "
            f"missing {', '.join('--' + m.replace('_', '-') for m in missing)}"
        )
    auto = getattr(args, "distributed", False) or any(
        os.environ.get(v) for v in ("JAX_COORDINATOR_ADDRESS", "STABLJAX_DISTRIBUTED")
    )
    if not given and not auto:
        return
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**(explicit if given else {}))


def is_primary() -> bool:
    """True on process 0 (the one that writes results and draws the progress bar)."""
    import jax

    return jax.process_index() == 0


def data_mesh():
    """A 1-D ``data`` mesh over every device of every process (data parallelism)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()), ("data",))


def batch_sharder(mesh, batch_size: int):
    """Returns ``put(batch)``: each process's slice of a global batch, sharded on ``data``.

    Every process computes the same global batch from its index (the batch functions are
    pure), keeps the rows its devices own, and assembles one global array, so the
    numbers do not depend on how many hosts or devices run.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.devices.size
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} must be divisible by the {n} devices")
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    def put(batch):
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: np.asarray(v[idx]))
            for k, v in batch.items()
        }

    return put


def precision_of(name: str):
    """``"fp32" | "bf16" | "fp16" | "fp16-noscale"`` -> a :class:`stabljax.Precision`."""
    import jax.numpy as jnp

    import stabljax

    if name == "fp32":
        return stabljax.Precision.fp32()
    if name == "bf16":
        return stabljax.Precision.bf16()
    if name == "fp16":
        return stabljax.Precision.fp16()
    if name == "fp16-noscale":
        return stabljax.Precision(compute_dtype=jnp.float16)
    raise ValueError(f"precision must be fp32, bf16, fp16 or fp16-noscale, got {name!r}")


def model_config(s: Setup, *, n_layers: int | None = None):
    """The :class:`stabljax.nn.TransformerConfig` of the reference model of ``s``."""
    from stabljax.nn import TransformerConfig

    return TransformerConfig(
        vocab_size=256,
        d_model=s.d_model,
        n_layers=n_layers or s.n_layers,
        n_heads=s.n_heads,
        max_len=s.seq_len,
        norm=s.norm,
        qk_norm=s.qk_norm,
        init_scheme=s.init_scheme,
    )


def build_model(s: Setup, *, n_layers: int | None = None):
    """The reference Transformer of ``s``; returns ``(model, config)``."""
    from flax import nnx

    from stabljax.nn import TransformerLM

    cfg = model_config(s, n_layers=n_layers)
    return TransformerLM(cfg, rngs=nnx.Rngs(s.seed)), cfg


@functools.lru_cache(maxsize=8)
def _initial_model(cfg, seed: int):
    from flax import nnx

    import stabljax
    from stabljax.nn import TransformerLM

    model = TransformerLM(cfg, rngs=nnx.Rngs(seed))
    return model, stabljax.nnx_apply(model)[1]


def initial_model(s: Setup):
    """``(model, params)`` of :func:`build_model`, built once per model config and seed.

    A sweep starts many runs from the same initialisation (every LR, every arm that
    changes only the optimizer); building it eagerly costs a few hundred ms each time on
    a small CPU. The params are never donated (:meth:`stabljax.TrainState.create` copies
    them), so sharing them between runs is safe.
    """
    return _initial_model(model_config(s), s.seed)


def lr_schedule(s: Setup):
    """Linear warmup over ``warmup_frac`` of the run, then cosine decay to 0."""
    import optax

    warmup = int(round(s.warmup_frac * s.steps))
    if warmup == 0:
        return optax.cosine_decay_schedule(s.lr, s.steps)
    return optax.warmup_cosine_decay_schedule(0.0, s.lr, warmup, s.steps, end_value=0.0)


def adamw(s: Setup):
    """The proxy's optimizer: ``clip_by_global_norm(clip)`` then AdamW (0 clip: none)."""
    import optax

    opt = optax.adamw(lr_schedule(s), b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
    return optax.chain(optax.clip_by_global_norm(s.clip), opt) if s.clip > 0 else opt


@functools.lru_cache(maxsize=4)
def _corpus(nbytes: int, path: str | None):
    """:func:`stabljax.default_corpus`, read once per process (it walks a source tree)."""
    import stabljax

    return stabljax.default_corpus(nbytes, path=path)


def corpus_batches(s: Setup, *, seed_offset: int = 0):
    """``batch_fn(i)`` over the corpus of ``s`` (``seed_offset`` 1 is the held-out stream)."""
    import stabljax

    corpus = _corpus(s.corpus_bytes, s.corpus)
    return stabljax.lm_batch_fn(
        corpus, batch_size=s.batch_size, seq_len=s.seq_len, seed=s.seed * 1000 + seed_offset
    )


@dataclasses.dataclass
class Run:
    """What :func:`train` returns: per-step metrics (host numpy) and the final state."""

    metrics: dict[str, Any]
    eval_loss: float
    init_loss: float
    state: Any
    apply_fn: Any


def evaluate(apply_fn, params, batches, put) -> float:
    """Mean cross-entropy of ``params`` over a fixed list of held-out batches."""
    import jax
    import numpy as np
    import optax

    @jax.jit
    def ce(params, batch):
        logits = apply_fn(params, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return float(np.mean([float(ce(params, put(b))) for b in batches]))


@dataclasses.dataclass
class Prepared:
    """One run of a setup, ready to train: what :func:`prepare` returns.

    Attributes:
      apply_fn: the model's ``apply_fn(params, inputs)``.
      params: the initial params, replicated over the data mesh.
      state: the initial :class:`stabljax.TrainState`.
      step: the jitted train step (:func:`stabljax.make_train_step`).
      put: ``put(batch)``, a host batch to a global array sharded over the mesh.
      eval_set: the held-out batches (host numpy).
    """

    apply_fn: Any
    params: Any
    state: Any
    step: Any
    put: Any
    eval_set: list

    def evaluate(self, params) -> float:
        """Mean held-out cross-entropy of ``params``."""
        return evaluate(self.apply_fn, params, self.eval_set, self.put)


def prepare(s: Setup, optimizer=None, *, precision: Any = None) -> Prepared:
    """Model, replicated params, train state and step, data placement and held-out set of ``s``.

    Args:
      s: the setup.
      optimizer: an Optax optimizer; default :func:`adamw` of ``s``.
      precision: a :class:`stabljax.Precision`; default ``precision_of(s.precision)``.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import stabljax

    model, params = initial_model(s)
    apply_fn, _ = stabljax.nnx_apply(model)
    optimizer = optimizer if optimizer is not None else adamw(s)
    precision = precision or precision_of(s.precision)
    mesh = data_mesh()
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    held_out = corpus_batches(s, seed_offset=1)
    return Prepared(
        apply_fn=apply_fn,
        params=params,
        state=stabljax.TrainState.create(params, optimizer, precision=precision),
        step=stabljax.make_train_step(
            stabljax.lm_loss(apply_fn, z_loss=s.z_loss), optimizer, precision=precision
        ),
        put=batch_sharder(mesh, s.batch_size),
        eval_set=[held_out(i) for i in range(s.eval_batches)],
    )


def train(
    s: Setup,
    optimizer=None,
    *,
    batch_fn=None,
    aux_every: int = 0,
    progress: Any = None,
) -> Run:
    """Trains the reference model of ``s`` with :func:`stabljax.make_train_step`.

    Metrics stay on device during the loop and are fetched once at the end, so the host
    never waits on the device. With ``aux_every > 0`` the max attention logit is measured
    every that many steps (a separate forward pass).

    Args:
      s: the setup.
      optimizer: an Optax optimizer; default :func:`adamw` of ``s``.
      batch_fn: ``batch_fn(i)``; default :func:`corpus_batches` of ``s``.
      aux_every: measure the model's max attention logit this often (0: never).
      progress: a callable ``progress(n)`` advanced once per step (e.g. ``tqdm.update``).

    Returns:
      A :class:`Run`.
    """
    import jax
    import numpy as np

    import stabljax

    run = prepare(s, optimizer)
    aux_fn, _ = stabljax.nnx_apply(initial_model(s)[0], return_aux=True)
    batch_fn = batch_fn or corpus_batches(s)
    init_loss = run.evaluate(run.params)
    state, step, put = run.state, run.step, run.put
    aux_jit = jax.jit(lambda p, x: aux_fn(p, x)[1]["max_attn_logit"])
    history, attn = [], []
    for i in range(s.steps):
        batch = put(batch_fn(i))
        if aux_every and i % aux_every == 0:
            attn.append((i, aux_jit(state.params, batch["inputs"])))
        state, m = step(state, batch)
        history.append(m)
        if progress is not None:
            progress(1)
    fetched = jax.device_get(history)
    metrics = {k: np.array([m[k] for m in fetched]) for k in fetched[0] if k != "layers"}
    if attn:
        metrics["attn_step"] = np.array([i for i, _ in attn])
        metrics["max_attn_logit"] = np.array(jax.device_get([a for _, a in attn]))
    return Run(
        metrics=metrics,
        eval_loss=run.evaluate(state.params),
        init_loss=init_loss,
        state=state,
        apply_fn=run.apply_fn,
    )


def progress_bar(total: int, desc: str, *, disable: bool = False):
    """A tqdm bar (a no-op object when tqdm is missing or ``disable``)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # experiments extra not installed
        tqdm = None
    if tqdm is None or disable or not is_primary():

        class _Null:
            def __init__(self, total):
                self.total = total

            def update(self, n=1):
                pass

            def refresh(self):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null(total)
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def grow_bar(bar: Any, steps: int) -> None:
    """Adds ``steps`` to a :func:`progress_bar`'s total: a rollback's replay is work too,
    so a bar that counts compute steps ends full, never past its total."""
    if steps > 0:
        bar.total += steps
        bar.refresh()


def finite_or_nan(x: float) -> float:
    """``x`` if finite else NaN (so tables show one marker for a diverged run)."""
    return float(x) if math.isfinite(float(x)) else float("nan")


def save_figure(fig, path: pathlib.Path) -> None:
    """Writes a matplotlib figure as PNG through a temporary file (never half-written).

    Process 0 alone writes in a multi-process run.
    """
    if not is_primary():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------
# Sweeps: one compile per arm, any number of (learning rate, seed, ...) runs through it.
# --------------------------------------------------------------------------------------


def unit_schedule(s: Setup):
    """:func:`lr_schedule` of ``s`` with peak 1 (multiplied by a traced learning rate)."""
    return lr_schedule(dataclasses.replace(s, lr=1.0))


def adamw_factory(s: Setup, *, clip: float | None = None):
    """``factory(learning_rate) -> optimizer``: :func:`adamw` of ``s`` with a traced peak LR.

    The returned factory is what :class:`Trainer` wraps in ``optax.inject_hyperparams``:
    the learning rate lives in the optimizer state, so every LR of a sweep runs through
    one compiled step.
    """
    import optax

    unit = unit_schedule(s)
    clip = s.clip if clip is None else clip

    def factory(learning_rate):
        opt = optax.adamw(
            lambda c: learning_rate * unit(c),
            b1=s.b1,
            b2=s.b2,
            eps=s.eps,
            weight_decay=s.weight_decay,
        )
        return optax.chain(optax.clip_by_global_norm(clip), opt) if clip > 0 else opt

    return factory


#: XLA options for the experiments' programs: LLVM's optimisation level 0. On a small CPU
#: model it compiles 2-3x faster and runs as fast (the time is in XLA's own kernels).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class AotJit:
    """A jitted function compiled ahead of time with XLA ``options`` on its first call.

    ``jax.jit`` accepts compiler options only through ``.lower(...).compile(options)``;
    this wrapper does that lazily and keeps one executable per argument signature (a
    step whose output state differs from its input in a weak type gets a second one).
    """

    def __init__(self, jitted, options: dict | None = None):
        self.jitted, self.options, self._exe = jitted, dict(options or {}), []

    def __call__(self, *args):
        for exe in self._exe:
            try:
                return exe(*args)
            except (TypeError, ValueError):  # another signature: compile it too
                continue
        exe = self.jitted.lower(*args).compile(self.options or None)
        self._exe.append(exe)
        return exe(*args)


_EVAL_PROGRAMS: dict[Any, tuple[AotJit, AotJit]] = {}


def _eval_programs(cfg, model, options: tuple) -> tuple[AotJit, AotJit]:
    """The held-out loss and the aux probe of a model config, compiled once per process.

    They depend on the model, not on the optimizer, so every :class:`Trainer` of a sweep
    whose arms differ only in the optimizer or the step shares them.
    """
    import jax
    import optax

    import stabljax

    key = (cfg, options)
    if key not in _EVAL_PROGRAMS:
        apply_fn, _ = stabljax.nnx_apply(model)
        aux_fn, _ = stabljax.nnx_apply(model, return_aux=True)

        def ce(params, batch):
            logits = apply_fn(params, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        def aux(params, x):
            _, a = aux_fn(params, x)
            return a["max_attn_logit"], a["residual_rms"]

        opts = dict(options)
        _EVAL_PROGRAMS[key] = (AotJit(jax.jit(ce), opts), AotJit(jax.jit(aux), opts))
    return _EVAL_PROGRAMS[key]


class Trainer:
    """Trains the reference model of ``s`` for many (seed, hyperparameter) settings.

    The train step, the held-out evaluation and the attention-logit probe are compiled
    once (on the first :meth:`run`); later runs with other seeds or other values of the
    injected hyperparameters reuse them. On a small CPU the compile costs as much as a
    few hundred steps, so a sweep of dozens of runs spends its time training. Numbers
    are the same as a fresh :func:`train` of the same setup (same init, data, schedule).

    Args:
      s: the setup; its ``seed`` and ``lr`` are overridden per run.
      factory: ``factory(**hparams) -> optimizer`` whose numeric arguments are injected
        with ``optax.inject_hyperparams`` (traced, in the state); default
        :func:`adamw_factory` of ``s`` (one hyperparameter, ``learning_rate``).
      compiler_options: XLA options for the compiled programs (default
        :data:`FAST_COMPILE`).
      precision: a :class:`stabljax.Precision` (default ``precision_of(s.precision)``).
    """

    def __init__(
        self,
        s: Setup,
        factory=None,
        *,
        compiler_options: dict | None = None,
        precision: Any = None,
    ):
        self.s = s
        self.factory = factory or adamw_factory(s)
        self.precision = precision
        self.compiler_options = FAST_COMPILE if compiler_options is None else compiler_options
        self._compiled = None

    def optimizer(self, **hparams):
        import optax

        return optax.inject_hyperparams(self.factory)(**hparams)

    def _compile(self, model, hparams):
        import stabljax

        apply_fn, _ = stabljax.nnx_apply(model)
        precision = self.precision or precision_of(self.s.precision)
        step = stabljax.make_train_step(
            stabljax.lm_loss(apply_fn, z_loss=self.s.z_loss),
            self.optimizer(**hparams),
            precision=precision,
        )
        opts = self.compiler_options
        ce, aux = _eval_programs(model_config(self.s), model, tuple(sorted(opts.items())))
        self._compiled = (apply_fn, AotJit(step, opts), ce, aux, precision)

    def run(
        self,
        seed: int,
        *,
        batch_fn=None,
        aux_every: int = 0,
        progress: Any = None,
        keep_state: bool = False,
        overrides: dict[str, Any] | None = None,
        **hparams,
    ) -> Run:
        """One training run; ``hparams`` go to the factory (e.g. ``learning_rate=1e-2``).

        With ``aux_every > 0`` the max attention logit and the per-block residual RMS
        are measured every that many steps (``metrics["max_attn_logit"]``,
        ``metrics["residual_rms"]``, steps in ``metrics["attn_step"]``). ``overrides``
        replaces :class:`Setup` fields that change values but not shapes (e.g.
        ``init_scheme``), so one compile serves them all.
        """
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        import stabljax

        lr = hparams.get("learning_rate", self.s.lr)
        s = dataclasses.replace(self.s, seed=seed, lr=float(lr), **(overrides or {}))
        model, params = initial_model(s)
        if self._compiled is None:
            self._compile(model, hparams)
        apply_fn, step, ce, aux, precision = self._compiled
        mesh = data_mesh()
        put = batch_sharder(mesh, s.batch_size)
        batch_fn = batch_fn or corpus_batches(s)
        held_out = corpus_batches(s, seed_offset=1)
        eval_set = [put(held_out(i)) for i in range(s.eval_batches)]
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))

        def evaluate_(p):
            return float(np.mean(jax.device_get([ce(p, b) for b in eval_set])))

        init_loss = evaluate_(params)
        state = stabljax.TrainState.create(params, self.optimizer(**hparams), precision=precision)
        history, probes = [], []
        for i in range(s.steps):
            batch = put(batch_fn(i))
            if aux_every and i % aux_every == 0:
                probes.append((i, aux(state.params, batch["inputs"])))
            state, m = step(state, batch)
            history.append({k: v for k, v in m.items() if k != "layers"})
            if progress is not None:
                progress(1)
        fetched = jax.device_get(history)
        metrics = {k: np.array([m[k] for m in fetched]) for k in fetched[0]}
        if probes:
            got = jax.device_get([p for _, p in probes])
            metrics["attn_step"] = np.array([i for i, _ in probes])
            metrics["max_attn_logit"] = np.array([a for a, _ in got])
            metrics["residual_rms"] = np.stack([r for _, r in got])
        eval_loss = evaluate_(state.params)
        return Run(
            metrics=metrics,
            eval_loss=eval_loss,
            init_loss=init_loss,
            state=state if keep_state else None,
            apply_fn=apply_fn,
        )


def sweep(cells: Sequence[dict[str, Any]], run_cell, *, steps: int, desc: str, disable=False):
    """Runs ``run_cell(cell, progress)`` for every cell under one progress bar.

    ``progress(n)`` advances the bar by ``n`` training steps (``steps`` per cell); the
    postfix names the cell running. Returns the list of results, in the cells' order.
    """
    bar = progress_bar(len(cells) * steps, desc, disable=disable)
    out = []
    try:
        for cell in cells:
            bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in cell.items()))
            out.append(run_cell(cell, bar.update))
    finally:
        bar.close()
    return out


def log_grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    """``n`` log-spaced values from ``lo`` to ``hi`` (both included), rounded to 3 digits."""
    import numpy as np

    return tuple(float(f"{v:.3g}") for v in np.geomspace(lo, hi, n))


def lr_sensitivity(final_losses: Sequence[float], init_loss: float) -> float:
    """Wortsman et al.'s LR sensitivity of one LR sweep.

    .. math:: \\mathbb{E}_{\\eta}[\\min(\\ell(\\eta), \\ell_0)] - \\min_\\eta \\ell(\\eta)

    over the grid, with :math:`\\ell_0` the loss at init; a diverged (non-finite) run
    counts as :math:`\\ell_0`.
    """
    import numpy as np

    x = np.array([v if math.isfinite(v) else init_loss for v in map(float, final_losses)])
    x = np.minimum(x, init_loss)
    return float(x.mean() - x.min())


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half the max-min range (the spread over seeds) of ``values``."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    return float(np.mean(v)), float((np.max(v) - np.min(v)) / 2) if v.size else float("nan")


def plot_groups(
    rows: Sequence[dict[str, Any]],
    *,
    x: str,
    y: str,
    group: str,
    path: pathlib.Path,
    title: str,
    logx: bool = True,
    xlabel: str | None = None,
    ylabel: str | None = None,
    ylim: tuple[float, float] | None = None,
) -> None:
    """``y`` against ``x``, one line per ``group``: mean over seeds, min-max band.

    Rows with the same ``(group, x)`` are seeds; a non-finite ``y`` is drawn as a cross at
    the top of the axis (a diverged run).
    """
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups = list(dict.fromkeys(r[group] for r in rows))
    top = ylim[1] if ylim else None
    for g in groups:
        xs = sorted({r[x] for r in rows if r[group] == g})
        ys = [[float(r[y]) for r in rows if r[group] == g and r[x] == v] for v in xs]
        fin = [[v for v in yy if math.isfinite(v)] for yy in ys]
        mean = np.array([np.mean(f) if f else np.nan for f in fin])
        lo = np.array([np.min(f) if f else np.nan for f in fin])
        hi = np.array([np.max(f) if f else np.nan for f in fin])
        (line,) = ax.plot(xs, mean, marker="o", ms=4, label=str(g))
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        bad = [v for v, yy in zip(xs, ys, strict=True) if any(not math.isfinite(t) for t in yy)]
        if bad and top is not None:
            ax.plot(bad, [top * 0.98] * len(bad), "x", color=line.get_color())
    if logx:
        ax.set_xscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """The fields every sweep experiment shares; each experiment subclasses it.

    Defaults are sized for a loaded 2-core CPU (a few minutes per experiment); pass
    larger values (``--d-model 128 --steps 2000``) on a GPU or TPU. ``quick()`` is the
    smoke-test size a test runs in seconds.
    """

    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    steps: int = 200
    warmup_frac: float = 0.05
    weight_decay: float = 1e-4
    seeds: tuple[int, ...] = (0, 1)
    corpus: str | None = None

    @classmethod
    def quick(cls):
        return cls(d_model=16, n_layers=1, n_heads=2, seq_len=16, batch_size=8, steps=6, seeds=(0,))

    def setup(self, **overrides) -> Setup:
        """The :class:`Setup` of this config, with ``overrides`` applied."""
        base = Setup(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            steps=self.steps,
            warmup_frac=self.warmup_frac,
            weight_decay=self.weight_decay,
            corpus=self.corpus,
            eval_batches=2 if self.steps < 20 else 8,
        )
        return dataclasses.replace(base, **overrides)


def curve_summary(run: Run, every: int = 1) -> dict[str, Any]:
    """The per-step training curves of ``run`` worth keeping in results.json (subsampled)."""
    m = run.metrics
    out = {"loss": m["loss"][::every], "log_z": m["log_z"][::every], "every": every}
    if "max_attn_logit" in m:
        out["attn_step"] = m["attn_step"]
        out["max_attn_logit"] = m["max_attn_logit"]
    return out


def spike_steps(losses: Sequence[float], **detector_kwargs) -> list[int]:
    """Steps where :class:`stabljax.SpikeDetector` flags a loss spike (first of each episode).

    The detector, fed one loss a step as a training loop feeds it, answers every anomalous
    step; consecutive anomalous steps are one episode, reported at its first step. A
    non-finite loss ends the scan and counts as one last spike at its step.
    """
    import stabljax

    det, out, inside = stabljax.SpikeDetector(**detector_kwargs), [], False
    for i, x in enumerate(map(float, losses)):
        if not math.isfinite(x):
            return [*out, i]
        flagged = det.update(i, {"loss": x}) is not None
        if flagged and not inside:
            out.append(i)
        inside = flagged
    return out


def steps_lost(losses: Sequence[float], spikes: Sequence[int], *, window: int = 10) -> int:
    """Training steps spent above the pre-spike loss, summed over ``spikes``.

    For a spike at step ``i`` the reference is the lowest loss of the ``window`` steps
    before it; the spike costs the steps until the loss is back at or below it (to the
    end of the run if it never is). Overlapping episodes are counted once.
    """
    import numpy as np

    x = np.asarray(losses, dtype=float)
    lost, covered = 0, -1
    for i in spikes:
        if i <= covered:
            continue
        ref = np.min(x[max(0, i - window) : i]) if i > 0 else x[0]
        after = np.nonzero(np.isfinite(x[i + 1 :]) & (x[i + 1 :] <= ref))[0]
        end = i + 1 + int(after[0]) if after.size else len(x)
        lost += end - i
        covered = end
    return int(lost)

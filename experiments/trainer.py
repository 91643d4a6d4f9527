"""The one training loop of every sweep: many independent runs in one compiled program.

:class:`Trainer` builds the train step of a setup once (:func:`stabljax.make_train_step`),
``jax.vmap``s it over independent runs (seeds × learning rates × any injected
hyperparameter) and ``lax.scan``s it over steps, so a whole arm of a sweep is one XLA
program. Every step records the step's metrics (loss, gradient and update norms, skips,
loss-scale overflows), the max attention logit, the output log Z, and any ``probes`` of
the state (clip counters); every ``eval_every`` steps the held-out loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import stabljax
from experiments import common, proxy, stats

#: XLA options of the experiments' programs: LLVM's optimisation level 0 on CPU. On the
#: small proxy it compiles 2-3x faster and runs as fast (the time is in XLA's kernels).
FAST_COMPILE = {"xla_backend_optimization_level": 0}

_KEEP = ("loss", "grad_norm", "update_norm", "skipped", "overflow", "loss_scale", "log_z")


@dataclasses.dataclass
class Runs:
    """What :meth:`Trainer.run_many` returns, as host numpy.

    Attributes:
      specs: the runs, as given (``seed`` and hyperparameters).
      metrics: per-step metrics, each ``[runs, steps]``.
      eval_steps: the steps of the held-out evaluations (0 first: the loss at init).
      eval_loss: ``[runs, len(eval_steps)]``.
      params: the final parameters, stacked over runs (host numpy), or None unless
        ``run_many(..., keep_params=True)``.
    """

    specs: list[dict[str, Any]]
    metrics: dict[str, np.ndarray]
    eval_steps: np.ndarray
    eval_loss: np.ndarray
    params: Any = None

    @property
    def init_loss(self) -> np.ndarray:
        return self.eval_loss[:, 0]

    @property
    def final_loss(self) -> np.ndarray:
        return self.eval_loss[:, -1]

    def outcome(self, i: int) -> dict[str, Any]:
        """Run ``i``'s row fields that every sweep reports: its learning rate and seed, the
        held-out loss at init and at the end, whether it failed, and its loss bursts."""
        spec, init, final = self.specs[i], self.init_loss[i], self.final_loss[i]
        return {
            "lr": spec["learning_rate"],
            "seed": spec["seed"],
            "init_loss": float(init),
            "final_loss": common.finite_or_nan(final),
            "failed": stats.failed(final, init),
            "bursts": stats.burst_count(self.metrics["loss"][i]),
        }

    def index(self, **match: Any) -> list[int]:
        """Indices of the runs whose spec has every ``key == value`` of ``match``."""
        return [i for i, r in enumerate(self.specs) if all(r.get(k) == v for k, v in match.items())]


def default_eval_every(steps: int) -> int:
    """About ten held-out evaluations, at a period that divides ``steps``."""
    return math.gcd(steps, max(1, steps // 10))


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def _batches(batch_fn: Callable[[int], dict], indices: Sequence[int]) -> np.ndarray:
    """``[len(indices), B, T + 1]`` token windows (inputs are ``[..., :-1]``)."""
    out = []
    for i in indices:
        b = batch_fn(i)
        out.append(np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1))
    return np.stack(out).astype(np.int32)


class Trainer:
    """Trains the reference model of ``s`` for many (seed, hyperparameter) settings at once.

    Args:
      s: the setup; its ``seed`` (and any field in a run's ``overrides`` that changes
        values, not shapes, e.g. ``init_scheme``) is set per run.
      factory: ``factory(**hparams) -> optimizer`` whose numeric arguments are injected
        with ``optax.inject_hyperparams`` (traced, one value per run); default
        :func:`experiments.proxy.adamw_factory` of ``s`` (``learning_rate``).
      precision: a :class:`stabljax.Precision` (default ``precision_of(s.precision)``).
      eval_every: held-out evaluation period (default :func:`default_eval_every`).
      probes: ``{name: fn(state) -> scalar}`` recorded after every step (e.g. a clip
        counter read with ``optax.tree.get``).
      batch_fn: ``batch_fn(s_run) -> (i -> batch)`` of the training data (default
        :func:`experiments.proxy.corpus_batches`).
      compiler_options: XLA options (default :data:`FAST_COMPILE` on CPU).
    """

    def __init__(
        self,
        s: proxy.Setup,
        factory: Callable[..., optax.GradientTransformation] | None = None,
        *,
        precision: stabljax.Precision | None = None,
        eval_every: int | None = None,
        probes: dict[str, Callable[[Any], jax.Array]] | None = None,
        batch_fn: Callable[[proxy.Setup], Callable[[int], dict]] | None = None,
        compiler_options: dict | None = None,
    ):
        self.s = s
        self.factory = factory or proxy.adamw_factory(s)
        self.precision = precision or proxy.precision_of(s.precision)
        self.eval_every = eval_every or default_eval_every(s.steps)
        if s.steps % self.eval_every:
            raise ValueError(f"eval_every={self.eval_every} must divide steps={s.steps}")
        self.probes = dict(probes or {})
        self.batch_fn = batch_fn or proxy.corpus_batches
        if compiler_options is None:
            compiler_options = FAST_COMPILE if jax.default_backend() == "cpu" else {}
        self.compiler_options = compiler_options
        self._programs: dict[tuple, Any] = {}

    def optimizer(self, **hparams) -> optax.GradientTransformation:
        return optax.inject_hyperparams(self.factory)(**hparams)

    def _build(self, model, hparams: dict[str, float]):
        aux_apply, _ = stabljax.nnx_apply(model, return_aux=True)
        apply_fn, _ = stabljax.nnx_apply(model)
        z = self.s.z_loss

        def loss_fn(params, batch):
            logits, a = aux_apply(params, batch["inputs"])
            loss, aux = stabljax.cross_entropy_with_z_loss(
                logits, batch["targets"], z_loss_weight=z
            )
            return loss, {
                "log_z": aux["log_z"],
                "max_attn_logit": a["max_attn_logit"],
                # per layer and head: the step passes it to the optimizer as max_logits=
                # (stabljax.qk_clip reads it; every other optimizer ignores it)
                "max_attn_logits": a["max_attn_logits"],
                "max_residual_rms": jnp.max(a["residual_rms"]),
                "max_abs_logit": jnp.max(jnp.abs(logits)),
            }

        tx = self.optimizer(**hparams)
        step = stabljax.make_train_step(loss_fn, tx, precision=self.precision, donate=False)
        keep = (*_KEEP, "max_attn_logit", "max_residual_rms", "max_abs_logit")
        probes = self.probes

        def split(w):
            return {"inputs": w[..., :-1], "targets": w[..., 1:]}

        def one(state, window):
            state, m = step(state, split(window))
            out = {k: m[k] for k in keep}
            out |= {k: jnp.asarray(fn(state), jnp.float32) for k, fn in probes.items()}
            return state, out

        def held_out(params, windows):  # one run, windows [E, B, T + 1]
            def ce(w):
                b = split(w)
                return optax.softmax_cross_entropy_with_integer_labels(
                    apply_fn(params, b["inputs"]), b["targets"]
                ).mean()

            return jnp.mean(jax.lax.map(ce, windows))

        def chunk(state, windows, eval_set):  # windows [k, R, B, T + 1]
            state, ms = jax.lax.scan(jax.vmap(one), state, windows)
            return state, ms, jax.vmap(held_out)(state.params, eval_set)

        def init(params, hp):
            return stabljax.TrainState.create(params, self.optimizer(**hp), self.precision)

        opts = self.compiler_options or None
        return (
            jax.jit(jax.vmap(init), compiler_options=opts),
            jax.jit(chunk, donate_argnums=(0,), compiler_options=opts),
            jax.jit(jax.vmap(held_out), compiler_options=opts),
        )

    def scan(self, lrs, seeds, *, progress=None) -> list[dict[str, Any]]:
        """One arm over ``lrs`` x ``seeds`` in one vmapped program: each run's outcome."""
        specs = [{"seed": sd, "learning_rate": lr} for lr in lrs for sd in seeds]
        r = self.run_many(specs, progress=progress)
        return [r.outcome(i) for i in range(len(specs))]

    def run_many(
        self,
        runs: Sequence[dict[str, Any]],
        *,
        progress: Callable[[int], Any] | None = None,
        keep_params: bool = False,
    ) -> Runs:
        """Trains every run of ``runs`` (dicts of ``seed``, hyperparameters and optional
        ``overrides`` of :class:`Setup` fields) side by side; returns :class:`Runs`.

        ``progress(n)`` is advanced by ``n`` run-steps after each evaluation period;
        ``keep_params`` also returns the final parameters (``Runs.params``).
        """
        if not runs:
            raise ValueError("runs must name at least one run")
        specs = [dict(r) for r in runs]
        names = sorted(k for k in specs[0] if k not in ("seed", "overrides"))
        for r in specs:
            if sorted(k for k in r if k not in ("seed", "overrides")) != names:
                raise ValueError(f"every run must give the same hyperparameters {names}: {r}")
        setups = [
            dataclasses.replace(self.s, seed=int(r["seed"]), **r.get("overrides", {}))
            for r in specs
        ]
        built = [proxy.initial_model(si) for si in setups]
        model = built[0][0]
        mesh = Mesh(np.array(jax.devices()), ("data",))
        n_dev = mesh.devices.size
        if self.s.batch_size % n_dev:
            raise ValueError(f"batch_size={self.s.batch_size} must divide over {n_dev} devices")
        rep = NamedSharding(mesh, PartitionSpec())
        data = NamedSharding(mesh, PartitionSpec(None, None, "data"))
        params = jax.device_put(_stack([p for _, p in built]), rep)
        hp = {k: jnp.asarray([float(r[k]) for r in specs], jnp.float32) for k in names}
        hp = jax.device_put(hp, rep)
        key = (proxy.model_config(self.s), tuple(names))
        if key not in self._programs:
            self._programs[key] = self._build(model, {k: float(specs[0][k]) for k in names})
        init, chunk, held_out = self._programs[key]

        def put(x):
            return jax.make_array_from_callback(x.shape, data, lambda idx: x[idx])

        evals = [
            _batches(proxy.corpus_batches(si, seed_offset=1), range(si.eval_batches))
            for si in setups
        ]
        eval_set = put(np.stack(evals))  # [R, E, B, T + 1]
        state = init(params, hp)
        losses = [held_out(state.params, eval_set)]
        fns = [self.batch_fn(si) for si in setups]
        k, history = self.eval_every, []
        for start in range(0, self.s.steps, k):
            idx = range(start, start + k)
            windows = put(np.stack([_batches(fn, idx) for fn in fns], axis=1))
            if len(history) >= 2:  # at most two chunks in flight (BUILD.md, "Bounded dispatch")
                jax.block_until_ready(history[-2])
            state, ms, ev = chunk(state, windows, eval_set)
            history.append(ms)
            losses.append(ev)
            if progress is not None:
                progress(k * len(specs))
        history, losses = jax.device_get((history, losses))
        final = jax.device_get(state.params) if keep_params else None
        metrics = {
            name: np.concatenate([h[name] for h in history], axis=0).T for name in history[0]
        }
        return Runs(
            specs=specs,
            metrics=metrics,
            eval_steps=np.arange(0, self.s.steps + 1, k),
            eval_loss=np.stack(losses, axis=1).astype(float),
            params=final,
        )

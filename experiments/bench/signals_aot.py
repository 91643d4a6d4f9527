"""What the leading-indicator signals cost the train step on XLA:TPU, ahead of time.

The guarded train step of ``experiments.bench.train_step`` (``skip_nonfinite(skip_spikes(
chain(clip_by_zscore, safe_adamw)))``, bf16 compute, z-loss) compiled for a TPU topology
without and with ``make_train_step(signals=Signals(b2=0.999))`` (per-layer update/param RMS
ratio and Adam RMS, :func:`stabljax.telemetry.leading_signals`); the compiler's bytes
accessed and flops of both, and their ratio. Needs libtpu (``pip install -e ".[tpu]"``), no
TPU: nothing runs (experiments/bench/aot_tpu.py). Goal (issue 51): at most 1 % more bytes.

Run from the repository root::

    python -m experiments.bench.signals_aot            # v5e:2x4, 185M data-parallel, 1B FSDP
    python -m experiments.bench.signals_aot --quick    # tiny models, seconds
"""

from __future__ import annotations

import dataclasses

import optax

import stabljax
from experiments import cli
from experiments.bench import aot_tpu
from stabljax.telemetry import Signals

SIZES = {
    "185M-data": dict(d_model=1024, n_layers=12, n_heads=16, parallelism="data"),
    "1B-fsdp": dict(d_model=2048, n_layers=18, n_heads=16, parallelism="fsdp"),
    "tiny-data": dict(d_model=64, n_layers=2, n_heads=4, parallelism="data"),
}
TARGETS = {f"bytes_signals/guarded ({k})": 1.01 for k in SIZES}


@dataclasses.dataclass(frozen=True)
class Config:
    """The TPU topology, the model sizes and the batch compiled for."""

    topology: str = "v5e:2x4"
    sizes: tuple[str, ...] = ("185M-data", "1B-fsdp")
    vocab: int = 32000
    seq_len: int = 1024
    batch_size: int = 64

    @classmethod
    def quick(cls) -> Config:
        return cls(sizes=("tiny-data",), vocab=256, seq_len=64, batch_size=8)


def steps(signals: Signals | None):
    """``make(apply_fn) -> (step, args_fn)`` of the guarded step, with or without signals."""
    precision = stabljax.Precision.bf16()

    def make(apply_fn):
        inner = optax.chain(stabljax.clip_by_zscore(), stabljax.safe_adamw(1e-3))
        opt = stabljax.skip_nonfinite(stabljax.skip_spikes(inner))
        loss_fn = stabljax.lm_loss(apply_fn, z_loss_weight=1e-4)
        step = stabljax.make_train_step(loss_fn, opt, precision=precision, signals=signals)

        return step, aot_tpu.train_state_args(opt)

    return make


def run(cfg: Config) -> tuple[list[dict], dict]:
    rows, ratios, per_size = [], {}, {}
    for size in cfg.sizes:
        res = aot_tpu.train_step_costs(
            cfg.topology,
            {"guarded": steps(None), "guarded+signals": steps(Signals(b2=0.999))},
            vocab=cfg.vocab,
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            **SIZES[size],
        )
        per_size[size] = res
        base, sig = res["per_step"]["guarded"], res["per_step"]["guarded+signals"]
        ratios[f"bytes_signals/guarded ({size})"] = sig["bytes"] / base["bytes"]
        ratios[f"flops_signals/guarded ({size})"] = sig["flops"] / base["flops"]
        for name, c in res["per_step"].items():
            rows.append(
                {
                    "model": size,
                    "params": f"{res['n_params'] / 1e6:.0f}M",
                    "step": name,
                    "bytes accessed": c["bytes"],
                    "bytes / guarded": c["bytes"] / base["bytes"],
                    "flops / guarded": c["flops"] / base["flops"],
                    "temp GiB": c["temp"] / 2**30,
                }
            )
    info = {"per_size": per_size, "ratios": ratios, "topology": cfg.topology}
    return rows, info | {"compiler": "XLA:TPU (AOT)"}


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.signals_aot", folder="bench/warning")
    rows, r = run(ex.cfg)
    title = f"Leading-indicator signals, XLA:TPU AOT for {ex.cfg.topology}"
    return ex.report(rows, r, targets=TARGETS, title=title, stem="signals_aot")


if __name__ == "__main__":
    main()

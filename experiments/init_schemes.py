"""Initialisation schemes on a deep, narrow model at a high learning rate.

A 12-layer, 32-wide reference model trained under each scheme of :mod:`stabljax.init`
named here: 0.02 everywhere (``fixed:0.02``), GPT-2's 0.02 with residual outputs scaled
by 1/√(2L) (``gpt2``), Nguyen & Salazar's small init (``small_init``), and per-layer
depth scaling (``depth_scaled``). Before training, :func:`stabljax.check_init` reports the
residual growth and flags; during training the per-block residual RMS is measured.
Reports the final loss, the growth exponent λ = (1/L)·log(‖h_L‖/‖h_0‖) at init and at the
end, and what ``check_init`` said.

    python -m experiments.init_schemes [--quick] [--schemes gpt2 small_init] [--lr 0.03]

(``python -m experiments.init`` is the same experiment under its short name.)

References:
  Nguyen & Salazar, `Transformers without Tears
  <https://arxiv.org/abs/1910.05895>`_, 2019
  Takase et al., `Spike No More: Stabilizing the Pre-training of Large Language Models
  <https://arxiv.org/abs/2312.16903>`_, 2023
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

import stabljax
from experiments import common

SCHEMES = ("fixed:0.02", "gpt2", "small_init", "depth_scaled")


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    n_layers: int = 12
    lr: float = 3e-2
    schemes: tuple[str, ...] = SCHEMES
    aux_every: int = 10

    @classmethod
    def quick(cls):
        base = {**dataclasses.asdict(common.SweepConfig.quick()), "n_layers": 3}
        return cls(**base, aux_every=2)


def growth(rms) -> float:
    rms = np.asarray(rms, dtype=float)
    return float(np.log(rms[-1] / rms[0]) / (len(rms) - 1))


def check(s: common.Setup, scheme: str, seed: int, apply_fn=None) -> stabljax.InitReport:
    """``check_init`` on the model the run starts from (same seed, same first batch).

    ``apply_fn`` (``nnx_apply(model, return_aux=True)`` of any model of this shape) is
    reused across schemes and seeds: the scheme sets the params, not the forward pass,
    and ``check_init`` compiles once per ``apply_fn``.
    """
    s = dataclasses.replace(s, init_scheme=scheme, seed=seed)
    model, params = common.initial_model(s)
    if apply_fn is None:
        apply_fn, _ = stabljax.nnx_apply(model, return_aux=True)
    return stabljax.check_init(apply_fn, params, common.corpus_batches(s)(0))


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="init")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    s = cfg.setup(lr=cfg.lr)
    trainer = common.Trainer(s)  # the scheme changes values, not shapes: one compile
    cells = [{"scheme": sc, "seed": sd} for sc in cfg.schemes for sd in cfg.seeds]
    curves = {}

    probe = stabljax.nnx_apply(common.initial_model(s)[0], return_aux=True)[0]

    def run_cell(c, advance):
        rep = check(s, c["scheme"], c["seed"], probe)
        r = trainer.run(
            c["seed"],
            learning_rate=cfg.lr,
            aux_every=cfg.aux_every,
            progress=advance,
            overrides={"init_scheme": c["scheme"]},
        )
        rms = r.metrics["residual_rms"]
        curves[(c["scheme"], c["seed"])] = {
            "loss": r.metrics["loss"],
            "rms_init": rms[0],
            "rms_end": rms[-1],
        }
        return {
            **c,
            "final_loss": common.finite_or_nan(r.eval_loss),
            "init_loss": r.init_loss,
            "check_ok": rep.ok,
            "check_flags": [f.name for f in rep.flags],
            "check_messages": [f"{f.message} Fix: {f.fix}" for f in rep.flags],
            "growth_init": rep.growth_exponent,
            "growth_end": growth(rms[-1]),
            "residual_rms_init": rms[0],
            "residual_rms_end": rms[-1],
            "max_attn_logit": float(np.nanmax(r.metrics["max_attn_logit"])),
        }

    rows = common.sweep(cells, run_cell, steps=cfg.steps, desc="init", disable=args.no_progress)
    table = []
    for sc in cfg.schemes:
        rr = [r for r in rows if r["scheme"] == sc]
        fl = common.mean_spread([r["final_loss"] for r in rr])
        flags = sorted({f for r in rr for f in r["check_flags"]})
        table.append(
            {
                "scheme": sc,
                "check_init": "ok" if not flags else "flags: " + ", ".join(flags),
                "λ at init": float(np.mean([r["growth_init"] for r in rr])),
                "λ at end": float(np.mean([r["growth_end"] for r in rr])),
                "max attn logit": float(np.mean([r["max_attn_logit"] for r in rr])),
                "final loss": "diverged"
                if not np.isfinite(fl[0])
                else f"{fl[0]:.3f} ± {fl[1]:.3f}",
            }
        )
    table = (
        f"{cfg.n_layers} layers × d_model {cfg.d_model}, lr {cfg.lr:g}, {cfg.steps} steps; "
        f"means over seeds {list(cfg.seeds)} (loss: ± half-range)\n\n"
        + common.markdown_table(table)
    )
    res = {"rows": rows}
    common.write_results(out, config=cfg, results=res, table=table, title="Initialisation schemes")
    plt = common.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, sc in enumerate(cfg.schemes):
        c = curves[(sc, cfg.seeds[0])]
        ax.plot(np.asarray(c["rms_init"]), "--", color=f"C{i}", lw=1)
        ax.plot(np.asarray(c["rms_end"]), "-", color=f"C{i}", label=sc)
        bx.plot(np.asarray(c["loss"], dtype=float), lw=0.9, color=f"C{i}", label=sc)
    ax.set(
        xlabel="block (0 = embedding)",
        ylabel="residual RMS",
        yscale="log",
        title="Residual stream RMS: init (dashed), end (solid)",
    )
    bx.set(
        xlabel="step",
        ylabel="training loss (nats/byte)",
        title=f"Training loss, seed {cfg.seeds[0]}",
    )
    for x in (ax, bx):
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    common.save_figure(fig, out / "init.png")
    plt.close(fig)
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])

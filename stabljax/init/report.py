"""What :func:`stabljax.init.check_init` returns: an :class:`InitReport` of :class:`InitFlag`."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class InitFlag:
    """One out-of-range finding of :func:`check_init`.

    Attributes:
      name: what was measured (``"residual_growth"``, ``"logit_std"``, ...).
      value: the measured value.
      bound: the bound it broke.
      message: what is wrong, with numbers.
      fix: a concrete change that brings it back in range.
    """

    name: str
    value: float
    bound: float
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}"


@dataclasses.dataclass(frozen=True)
class InitReport:
    """What :func:`check_init` measured, and what it flagged.

    Attributes:
      loss: the initial loss.
      log_vocab: ``log(vocab_size)``, the loss of a uniform prediction.
      logit_std: std of the output logits over the vocabulary (RMS over positions).
      residual_rms: RMS of the residual stream at the input and after each block
        (``n_layers + 1`` values), or None when ``apply_fn`` returns no aux.
      growth_exponent: λ = (1/L)·log(‖h_L‖/‖h_0‖), or None without ``residual_rms``.
      grad_rms: gradient RMS of each layer's parameters, layer 0 first (empty when no
        parameter path holds a layer index).
      grad_growth_exponent: (1/L)·log(g_0/g_{L-1}), the growth of the gradient RMS from
        the last layer back to the first, or None with fewer than 2 layers.
      max_attn_logit: the max pre-softmax attention logit, when ``apply_fn`` reports it.
      seq_len: the sequence length of the batch.
      flags: the findings out of range, each with a fix.
    """

    loss: float
    log_vocab: float
    logit_std: float
    residual_rms: np.ndarray | None
    growth_exponent: float | None
    grad_rms: np.ndarray
    grad_growth_exponent: float | None
    max_attn_logit: float | None
    seq_len: int
    flags: tuple[InitFlag, ...]

    @property
    def ok(self) -> bool:
        """True when nothing was flagged."""
        return not self.flags

    @property
    def n_layers(self) -> int:
        """The depth the report saw (from ``residual_rms``, else from ``grad_rms``)."""
        if self.residual_rms is not None:
            return len(self.residual_rms) - 1
        return len(self.grad_rms)

    def __str__(self) -> str:
        def f(x):
            return "n/a" if x is None else f"{x:.4g}"

        lines = [
            f"init check: {'ok' if self.ok else f'{len(self.flags)} flag(s)'}",
            f"  initial loss    {f(self.loss)}  (log vocab {f(self.log_vocab)}, "
            f"excess {f(self.loss - self.log_vocab)})",
            f"  logit std       {f(self.logit_std)}",
            f"  growth λ        {f(self.growth_exponent)}  (residual ×"
            + (
                f(float(self.residual_rms[-1] / self.residual_rms[0]))
                if self.residual_rms is not None
                else "n/a"
            )
            + f" over {self.n_layers} layers)",
            f"  grad growth     {f(self.grad_growth_exponent)}",
            f"  max attn logit  {f(self.max_attn_logit)}  (seq len {self.seq_len})",
        ]
        n = max(self.n_layers, len(self.grad_rms))
        if n:
            lines.append("  layer  residual RMS  grad RMS")
            for i in range(n + 1):
                res = self.residual_rms[i] if self.residual_rms is not None else None
                if i == 0:
                    name, g = "input", None
                else:
                    name = str(i - 1)
                    g = self.grad_rms[i - 1] if i - 1 < len(self.grad_rms) else None
                lines.append(f"  {name:<5}  {f(res):<12}  {f(g)}")
        for flag in self.flags:
            lines.append(f"  FLAG {flag.name}: {flag}")
        return "\n".join(lines)

from flax import nnx

import stabljax
from stabljax.reference import TransformerConfig, TransformerLM, default_corpus, lm_batch_fn

config = TransformerConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, max_len=64)
model = TransformerLM(config, rngs=nnx.Rngs(0))
apply_fn, params = stabljax.nnx_apply(model)  # a pure function + the nnx.State of the params
optimizer = stabljax.skip_nonfinite(
    stabljax.skip_spikes(stabljax.safe_adamw(learning_rate=3e-3, b2=0.95))
)
precision = stabljax.Precision.bf16()  # float32 master weights, bf16 compute, float32 loss
loss_fn = stabljax.lm_loss(apply_fn, z_loss_weight=1e-4)  # cross-entropy + z-loss of the logits
train_step = stabljax.make_train_step(loss_fn, optimizer, precision=precision)
state = stabljax.TrainState.create(params, optimizer, precision)
batches = lm_batch_fn(default_corpus(1_000_000), batch_size=8, seq_len=32)

history = []
for i in range(40):
    state, metrics = train_step(state, batches(i))  # one jitted call, no host sync
    history.append(metrics)  # device scalars: read them late, e.g. when logging
    if i % 10 == 9:
        print(f"step {i + 1}: loss {float(metrics['loss']):.3f} skipped {bool(metrics['skipped'])}")
model = stabljax.nnx_merge(model, state.params)  # the trained nnx.Module

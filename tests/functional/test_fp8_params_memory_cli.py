"""`--fp8-param-gather` through `pretrain_gpt.py` (in-process, one gloo rank, CPU, bf16): in the training loop the
FP8 linears' weights hold no bf16 storage of their own (FP8 bytes only: `megatron.core.fp8.params`)."""
from megatron.core.fp8.params import held_bytes, is_fp8_primary
from tests.functional.cli import reset_training_state, run_pretrain_in_process
from tests.functional.test_optimization_plan_cli import FLAGS


def test_fp8_param_gather_weights_hold_only_fp8_bytes_in_training():
    seen = []

    def hook(model):
        weights = [p for p in model.parameters() if getattr(p, "fp8_param", False)]
        seen.append((len(weights), all(is_fp8_primary(w) and w.untyped_storage().nbytes() == 2 for w in weights),
                     sum(held_bytes(w) for w in weights) / sum(2 * w.numel() for w in weights)))

    reset_training_state()
    flags = FLAGS[:FLAGS.index("--save-interval")] + [
        "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
        "--use-distributed-optimizer"]
    code, losses = run_pretrain_in_process(flags, hook=hook)
    assert code is None and len(losses) == 2
    assert seen and all(count == 8 and primary and ratio <= 0.55 for count, primary, ratio in seen), seen

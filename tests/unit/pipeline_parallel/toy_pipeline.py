"""A toy pipeline model for schedule tests: a stack of Linear+tanh layers split across stages.

Stage inputs come from `set_input_tensor` (as in Megatron models) except on the first stage, where
the microbatch's `x` is used. The loss is the masked sum of squares of the last activation, with
the mask's token count, returned as Megatron's 3-tuple `(loss, num_tokens, report)`.
"""
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, BATCH, HIDDEN = 6, 2, 8


def toy_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=8, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def all_layer_params(num_layers: int, seed: int = 1234):
    """Deterministic (weight, bias) of every layer; identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.5, torch.randn(HIDDEN, generator=gen) * 0.1)
        for _ in range(num_layers)
    ]


def microbatches(num_microbatches: int, seed: int = 99, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        x = torch.randn(seq, BATCH, HIDDEN, generator=gen)
        mask = (torch.rand(seq, BATCH, generator=gen) > 0.3).float()
        mask[0, 0] = 1.0
        out.append({"x": x, "mask": mask})
    return out


class ToyStage(torch.nn.Module):
    """Layers `layer_ids` of the toy stack; `pre_process` marks the stage that reads the data."""

    def __init__(self, config, layer_ids, params, pre_process: bool, post_process: bool):
        super().__init__()
        self.config = config
        self.model_type = None
        self.layer_ids = list(layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = torch.nn.ModuleList()
        for i in self.layer_ids:
            layer = torch.nn.Linear(HIDDEN, HIDDEN)
            with torch.no_grad():
                layer.weight.copy_(params[i][0])
                layer.bias.copy_(params[i][1])
            self.layers.append(layer)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, x):
        hidden = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden

    def grads(self):
        return {i: (l.weight.grad.clone(), l.bias.grad.clone()) for i, l in zip(self.layer_ids, self.layers)}


class Wrapper(torch.nn.Module):
    """A DDP-like wrapper exposing `.module` (the schedules must look through it)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, *args):
        return self.module(*args)


def masked_square_loss(mask, output):
    loss = (output.float() ** 2 * mask.unsqueeze(-1)).sum()  # mask [s, b] -> [s, b, 1]
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"])
    return output, lambda out: masked_square_loss(batch["mask"], out)


def legacy_forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(out):
        loss, _, _ = masked_square_loss(batch["mask"], out)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def reference(params, batches, per_token: bool = False, legacy: bool = False, grad_scale: float = 1.0):
    """Single-process result: (per-microbatch loss sums, token counts, grads per layer)."""
    stage = ToyStage(toy_config(num_layers=len(params)), range(len(params)), params, True, True)
    sums, counts = [], []
    for batch in batches:
        loss, n, _ = masked_square_loss(batch["mask"], stage(batch["x"]))
        sums.append(float(loss.detach()))
        counts.append(int(n))
        if legacy:
            scaled = loss / len(batches)
        elif per_token:
            scaled = loss
        else:
            scaled = loss / n / len(batches)
        (scaled * grad_scale).backward()
    return sums, counts, stage.grads()


def assert_close(actual, expected, rtol=1e-6, atol=1e-7, what=""):
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3e} (scale {expected.abs().max().item():.3e})")

"""BERT TP=2, BERT PP=2 (1F1B, tied embeddings across stages) and T5 TP=2 (relative position bias, cross
attention) against the same model in one process, in ONE gloo launch of world 2.

Every rank first builds the single-process reference (TP=PP=1) and computes its losses and gradients, then
builds each parallel layout from the reference weights (sliced per TP rank, layers renumbered per stage)
and runs the same microbatches through `get_forward_backward_func()` with DDP + `finalize_model_grads`.
Losses and gradients must match to 1e-5 (fp32; only reduction orders differ).
"""
import copy
import functools

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.T5 import t5_spec
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import assert_case_reports, run_on_ranks, tp_slice

VOCAB, SEQ, DEC_SEQ, MBS, HIDDEN, HEADS, MICROBATCHES = 64, 16, 8, 2, 32, 4, 2
CASES = [dict(name="bert-tp2", model="bert", tp=2, pp=1), dict(name="bert-pp2", model="bert", tp=1, pp=2),
         dict(name="t5-tp2", model="t5", tp=2, pp=1)]


def _config(tp=1, pp=1):
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=64,
                             use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
                             attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _build(case, config):
    if case["model"] == "bert":
        return BertModel(config, 2, get_bert_layer_local_spec(), VOCAB, SEQ,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=True)
    return T5Model(config, copy.deepcopy(config), t5_spec.get_t5_encoder_with_local_block_spec(2),
                   t5_spec.get_t5_decoder_with_local_block_spec(2), VOCAB, SEQ,
                   share_embeddings_and_output_weights=True, position_embedding_type="relative")


def _batches(case):
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(MICROBATCHES):
        pad = torch.ones(MBS, SEQ, dtype=torch.long)
        pad[1, 11:] = 0  # row 1 is padded
        loss_mask = (torch.rand(MBS, SEQ, generator=gen) < 0.3).long() * pad
        loss_mask[0, 1] = 1
        batch = dict(tokens=torch.randint(1, VOCAB, (MBS, SEQ), generator=gen) * pad, padding_mask=pad,
                     types=torch.randint(0, 2, (MBS, SEQ), generator=gen) * pad, loss_mask=loss_mask.float(),
                     labels=torch.where(loss_mask > 0, torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), -1),
                     is_random=torch.randint(0, 2, (MBS,), generator=gen))
        if case["model"] == "t5":
            dec_pad = torch.ones(MBS, DEC_SEQ, dtype=torch.long)
            dec_pad[0, 6:] = 0
            batch.update(dec_tokens=torch.randint(1, VOCAB, (MBS, DEC_SEQ), generator=gen) * dec_pad,
                         dec_labels=torch.randint(0, VOCAB, (MBS, DEC_SEQ), generator=gen),
                         dec_loss_mask=dec_pad.float())
        out.append(batch)
    return out


def _bert_loss(batch, output):
    lm, sop_logits = output
    mask = batch["loss_mask"].view(-1)  # [b, s] -> [b*s]
    lm_loss = torch.sum(lm.float().view(-1) * mask) / mask.sum()
    sop = F.cross_entropy(sop_logits.view(-1, 2).float(), batch["is_random"].view(-1), ignore_index=-1)
    return lm_loss + sop, {"loss": (lm_loss + sop).detach().view(1)}


def _t5_loss(batch, output):
    mask = batch["dec_loss_mask"].view(-1)  # [b, s] -> [b*s]
    loss = torch.sum(output.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"loss": torch.stack([loss.detach(), tokens.detach().float()])}


def _run(model, batch):
    if isinstance(model, BertModel) or isinstance(getattr(model, "module", None), BertModel):
        return model(batch["tokens"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"])
    enc_mask = (batch["padding_mask"] < 0.5)[:, None, None, :]  # [b, s] -> [b, 1, 1, s]
    return model(batch["tokens"], batch["dec_tokens"], enc_mask, None, enc_mask, lm_labels=batch["dec_labels"])


def _forward_step(case, data_iterator, model):
    batch = next(data_iterator)
    loss = _bert_loss if case["model"] == "bert" else _t5_loss
    return _run(model, batch), functools.partial(loss, batch)


def _reference(case):
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    model = _build(case, _config())
    batches = _batches(case)
    losses = []
    if case["model"] == "bert":
        for batch in batches:
            loss, _ = _bert_loss(batch, _run(model, batch))
            (loss / MICROBATCHES).backward()
            losses.append(float(loss))
    else:
        outs = [_t5_loss(batch, _run(model, batch)) for batch in batches]
        total_tokens = sum(int(t) for _, t, _ in outs)
        sum(loss for loss, _, _ in outs).div(total_tokens).backward()
        losses = [float(loss) / int(t) for loss, t, _ in outs]
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()
    return state, losses, grads


def _reference_name(model, name):
    parts = name.split(".")
    if parts[0] in ("encoder", "decoder") and parts[1] == "layers":
        parts[2] = str(getattr(model, parts[0]).layers[int(parts[2])].layer_number - 1)
    if parts[0] == "output_layer" and parts[1] == "weight":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def _parallel(case, state):
    parallel_state.initialize_model_parallel(case["tp"], case["pp"])
    model_parallel_cuda_manual_seed(11)
    config = _config(case["tp"], case["pp"])
    model = _build(case, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tp_slice(param, state[_reference_name(model, name)]))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, case), data_iterator=iter(_batches(case)), model=ddp,
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, decoder_seq_length=DEC_SEQ)
    last = parallel_state.is_pipeline_last_stage()
    if case["model"] == "bert":
        losses = [float(r["loss"][0]) for r in reports] if last else None
    else:
        losses = [float(r["loss"][0] / r["loss"][1]) for r in reports] if last else None
    grads = [(_reference_name(model, name), param, param.main_grad.clone()) for name, param in model.named_parameters()]
    result = dict(losses=losses)
    result["grads"] = [(name, grad, getattr(param, "partition_dim", None)
                        if getattr(param, "tensor_model_parallel", False) else None,
                        parallel_state.get_tensor_model_parallel_rank()) for name, param, grad in grads]
    parallel_state.destroy_model_parallel()
    return result


def _worker():
    out = []
    for case in CASES:
        _, ref_losses, ref_grads = reference = _reference(case)
        got = _parallel(case, reference[0])
        problems = []
        if got["losses"] is not None:
            for g, w in zip(got["losses"], ref_losses):
                if abs(g - w) > 1e-5 * max(1.0, abs(w)):
                    problems.append(f"{case['name']}: loss {g} != {w}")
        for name, grad, dim, tp_rank in got["grads"]:
            want = ref_grads[name] if dim is None else torch.chunk(ref_grads[name], case["tp"], dim=dim)[tp_rank]
            diff = (grad - want).abs().max().item()
            if diff > 1e-5 * max(want.abs().max().item(), 1e-3):
                problems.append(f"{case['name']}: grad {name} differs by {diff:.3e}")
        out.append(dict(problems=problems, names={n for n, _, _, _ in got["grads"]}, ref_names=set(ref_grads),
                        has_losses=got["losses"] is not None))
    return out


def test_bert_tp2_pp2_and_t5_tp2_match_one_process():
    results = run_on_ranks(_worker, 2, timeout=400)
    assert_case_reports(CASES, results)

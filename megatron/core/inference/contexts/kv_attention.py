"""Attention of new queries over cached keys/values, shared by the static and dynamic contexts."""
import torch
import torch.nn.functional as F

from megatron.core.transformer.rope_utils import apply_rotary_pos_emb


def rotary_table(rotary_pos_emb):
    """The [S, 1, 1, d] angle table (the query one, when a (q, k) pair is given), or None."""
    if rotary_pos_emb is None:
        return None
    if isinstance(rotary_pos_emb, tuple):
        if rotary_pos_emb[0] is not rotary_pos_emb[1] and not torch.equal(rotary_pos_emb[0], rotary_pos_emb[1]):
            raise ValueError("inference with different query and key rotary embeddings is not supported")
        return rotary_pos_emb[0]
    return rotary_pos_emb


def rotate(query, key, freqs, config):
    """Queries and keys rotated by `freqs` ([sq, 1 or b, 1, d]) when given."""
    if freqs is None:
        return query, key
    return apply_rotary_pos_emb(query, freqs, config=config), apply_rotary_pos_emb(key, freqs, config=config)


def check_value_in_key(key, value) -> None:
    """Under `cache_mla_latents` a layer's value must be a view of its key's leading channels (the latent of
    [latent | k_pe]): the contexts then store only the keys. Raises ValueError otherwise."""
    is_prefix = (value.data_ptr() == key.data_ptr() and value.shape[:-1] == key.shape[:-1]
                 and value.stride() == key.stride() and value.shape[-1] <= key.shape[-1])
    if not is_prefix:
        raise ValueError("an inference context with cache_mla_latents=True caches multi-latent attention latents: "
                         "the value must be a view of the key's leading channels; this layer's is not (build the "
                         "context with cache_mla_latents=False for other attention)")


def attend_padded(query, key, value, allowed, softmax_scale):
    """softmax(q k^T * scale) v per batch row.

    query [b, sq, np, hn], key/value [b, sk, ng, hn], allowed: None or bool [b, 1, sq, sk] (True: attend).
    Returns [b, sq, np, hn]."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, n, hn] -> [b, n, s, hn]
    if q.device.type == "cpu" and q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.to(query.dtype).transpose(1, 2)  # [b, np, sq, hn] -> [b, sq, np, hn]


__all__ = ["rotary_table", "rotate", "attend_padded", "check_value_in_key"]

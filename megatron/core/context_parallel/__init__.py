"""Context parallelism: a sequence split over ranks, attention across the split, and document masking.

- `layout`: which tokens each CP rank holds (Megatron's load-balanced split) and which key each query may
  see (causal order and documents);
- `kernels`: attention of one block of queries to one block of keys with its log-sum-exp, the online
  softmax merge, and the exact backward (math path on CPU, FlashAttention varlen kernels on CUDA);
- `attention`: the `--cp-comm-type` algorithms (p2p ring, all_gather, a2a, a2a+p2p) and
  document-restricted attention;
- `comm`: every collective of the above (the only module here that calls `torch.distributed`);
- `batch`: `get_batch_on_this_cp_rank`, Megatron's split of a batch along the sequence.
"""

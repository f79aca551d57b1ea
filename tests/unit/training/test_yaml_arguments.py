"""--yaml-cfg: a config file in Megatron's YAML layout gives the same arguments and configs as the command line.

The reference is the equivalent command line written out here by hand; the file uses Megatron's layout
(`language_model:` TransformerConfig fields, `model_parallel:` ModelParallelConfig fields, argument names at
the top level, `${VAR}` substitution, Megatron's `1.e-5` float spelling and runtime hooks set to null).
"""
import pytest

from megatron.training.arguments import ArgumentsError, _parse, core_transformer_config_from_args, validate_args

YAML = """\
# WARNING: Yaml configs is currently an experimental feature
language_model:
  num_layers: 3
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: 2
  ffn_hidden_size: null
  kv_channels: null
  hidden_dropout: 0.0
  attention_dropout: 0.0
  layernorm_epsilon: 1.e-6
  layernorm_zero_centered_gamma: True
  add_bias_linear: False
  gated_linear_unit: False
  activation_func: swiglu
  num_moe_experts: null
  init_method: null
  init_method_std: 0.01
  persist_layer_norm: False
  bias_dropout_fusion: True
  normalization: "RMSNorm"
  recompute_granularity: null
  fp8: null
model_parallel:
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  sequence_parallel: False
  perform_initialization: True
  fp16: False
  bf16: False
  params_dtype: null
  timers: null
  async_tensor_model_parallel_allreduce: True
  finalize_model_grads_func: null
  batch_p2p_comm: True
  deallocate_pipeline_outputs: False
# training:
micro_batch_size: 2
global_batch_size: 8
train_iters: 20
seq_length: 32
max_position_embeddings: 64
position_embedding_type: rope
untie_embeddings_and_output_weights: True
lr: 2.5e-4
min_lr: 2.5e-5
lr_decay_style: cosine
lr_warmup_iters: 2
weight_decay: 0.1
adam_eps: 1.e-08
clip_grad: 1.0
data_path: "${YAML_TEST_DATA}/a_text_document 0.5 ${YAML_TEST_DATA}/b_text_document"
split: '99,1,0'
tokenizer_type: NullTokenizer
vocab_size: 1000
delay_grad_reduce: True
log_interval: 5
"""

EQUIVALENT_CLI = (
    "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --norm-epsilon 1e-6 --apply-layernorm-1p --disable-bias-linear "
    "--swiglu --init-method-std 0.01 --no-persist-layer-norm --normalization RMSNorm "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 20 --seq-length 32 --max-position-embeddings 64 "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --lr 2.5e-4 --min-lr 2.5e-5 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --adam-eps 1e-8 --clip-grad 1.0 "
    "--data-path /data/a_text_document 0.5 /data/b_text_document --split 99,1,0 "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 5"
)


def _validated(argv):
    args = _parse(argv)
    args.world_size, args.rank = 1, 1
    return validate_args(args)


@pytest.fixture
def yaml_file(tmp_path, monkeypatch):
    monkeypatch.setenv("YAML_TEST_DATA", "/data")
    path = tmp_path / "gpt_config.yaml"
    path.write_text(YAML)
    return path


def test_yaml_equals_the_command_line(yaml_file):
    from_yaml = vars(_validated(["--yaml-cfg", str(yaml_file)]))
    from_cli = vars(_validated(EQUIVALENT_CLI.split()))
    assert from_yaml.pop("yaml_cfg") == str(yaml_file)
    assert from_cli.pop("yaml_cfg") is None
    differing = {key: (from_yaml.get(key), from_cli.get(key)) for key in set(from_yaml) | set(from_cli)
                 if from_yaml.get(key) != from_cli.get(key)}
    assert not differing
    config = core_transformer_config_from_args(_validated(["--yaml-cfg", str(yaml_file)]))
    assert (config.num_layers, config.num_query_groups, config.layernorm_epsilon) == (3, 2, 1e-6)
    assert config.gated_linear_unit and config.layernorm_zero_centered_gamma and config.init_method_std == 0.01
    assert config.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 and config.normalization == "RMSNorm"


def test_command_line_flags_override_the_file(yaml_file):
    args = _validated(["--yaml-cfg", str(yaml_file), "--lr", "1e-3", "--num-layers", "2"])
    assert (args.lr, args.num_layers, args.min_lr) == (1e-3, 2, 2.5e-5)


def test_every_problem_of_the_file_is_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    bad = YAML.replace("micro_batch_size: 2", "micro_batch_sise: 2\nmicro_batch_size: two") \
        .replace("window_size: null", "").replace("fp8: null", "fp8: e5m2\n  window_size: [4, 4]") \
        .replace("${YAML_TEST_DATA}", "${NOT_SET_ANYWHERE}").replace("swiglu\n", "relu6\n", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    with pytest.raises(ArgumentsError) as err:
        _validated(["--yaml-cfg", str(path), "--num-layer", "2"])
    text = str(err.value)
    for piece in ("top-level key 'micro_batch_sise'", "micro_batch_size is 'two'", "language_model.fp8 is 'e5m2'",
                  "language_model.window_size = [4, 4]: no flag sets this field", "${NOT_SET_ANYWHERE}",
                  "language_model.activation_func is 'relu6'", "did you mean --num-layers"):
        assert piece in text, (piece, text)


def test_missing_file_is_a_validation_error(tmp_path):
    with pytest.raises(ArgumentsError, match="cannot read the file"):
        _validated(["--yaml-cfg", str(tmp_path / "nope.yaml")] + "--num-layers 2 --hidden-size 8 "
                   "--num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 --micro-batch-size 1".split())


def test_megatron_yaml_api(yaml_file, monkeypatch):
    from megatron.training.yaml_arguments import core_transformer_config_from_yaml, load_yaml, validate_yaml

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = validate_yaml(load_yaml(str(yaml_file)))
    assert (args.yaml_cfg, args.num_layers, args.norm_epsilon, args.rank) == (str(yaml_file), 3, 1e-6, 1)
    config = core_transformer_config_from_yaml(args, "language_model")
    assert config.num_query_groups == 2 and config.gated_linear_unit

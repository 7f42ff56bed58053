"""Sizes and configs the tests (and some benches) share: tiny run arguments, the deep and GGUF DiT configs, the
memory-test DiTs."""

# The generate() arguments of most core tests.
TINY = dict(height=64, width=96, num_frames=5, steps=3)

# The offload tests' frame size and seeded run.
SIZE = dict(height=64, width=96)
RUN = dict(SIZE, num_frames=5, steps=3, seed=7)

# Depth of the deep package (conftest's ``deep_package``): K + 2 < depth for the block ring.
DEPTH = 6

# A DiT whose rows are whole K-quant blocks (256 values), with 16 experts so that an index read as text
# ("10" < "2") would change the expert order.
GGUF_DIT = {"hidden_size": 256, "num_attention_heads": 2, "axes_dims": [32, 48, 48], "intermediate_size": 256,
            "moe_intermediate_size": 256, "num_experts": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}

# DiT configs for memory tests: few but wide layers, so writing the package is quick for its size.
MEMORY_DIT = {"hidden_size": 1536, "num_attention_heads": 12, "axes_dims": [32, 48, 48], "depth": 3,
              "intermediate_size": 6144}  # about 0.5 GiB per DiT in fp32
MEMORY_DIT_MEDIUM = {"hidden_size": 512, "num_attention_heads": 4, "axes_dims": [32, 48, 48], "depth": 2,
                     "intermediate_size": 2048}  # about 45 MiB per DiT

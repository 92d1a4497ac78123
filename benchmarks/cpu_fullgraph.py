#!/usr/bin/env python
"""`hpcbert train` on CPU with the attention a GPU run compiles: the CPU kernel (a graph break by
design, `model._cpu_attention`) replaced by the padded SDPA path CUDA takes in fp32
(`model.padded_attention`), so that `torch.compile` sees the whole model as one graph, as on a GPU.
With `TORCH_LOGS=recompiles` it shows, without a GPU, what a compiled GPU run recompiles for (the
padded path's own `T % 16` guard aside: flash varlen has none). A diagnostic, not a measurement:
the attention here is not the one a CPU run uses.

    TORCH_LOGS=recompiles PYTHONPATH=BERT python benchmarks/cpu_fullgraph.py train --task mlm \\
        --data-dir .gpudata/pretrain --tokenizer .gpudata/vocab --model bert-tiny --batch-size 16 \\
        --max-steps 14 --precision bf16 --compile on --no-do-eval --no-save-model --out /tmp/fullgraph
"""
import sys

from hpcbert import cli, model


def padded(qkv, tokens, n_head, p, pack_mask=False, reuse_mask=False):
    return model.padded_attention(qkv, tokens, n_head, p).reshape(qkv.shape[0], -1)


if __name__ == "__main__":
    model.attention = padded  # the attention module looks the function up at each call
    sys.exit(cli.main(sys.argv[1:]))

"""On a CUDA GPU: bert-base (or the models named) at length 512, bf16, per policy, the activation bytes per sequence as
`hpcbert plan` counts them (FakeTensorMode), the same count on real tensors, what is allocated after
the forward, the peak of forward + backward (each per sequence: batch 16 minus batch 8, over 8),
and backward's workspace as the plan counts it (plan.measure_workspace, FakeTensorMode) beside the
real one (peak less what the forward left allocated). Printed, one line per model, policy and task
(synthetic, and mlm: a masked-LM head's logits are in the count, not in plan.workspace_rule). The
real workspace of `all` against one plain layer's bytes ((none - all) / layers, as plan counts it)
is what plan.workspace_rule's factor for recomputing policies rests on (bert-base: the rule's two
layers left `all`'s planned batch 0.73x the probed one on an H200; bert-large: 0.90x).

    PYTHONPATH=BERT python3 benchmarks/gpu_activation_check.py [synthetic,mlm] [bert-base,bert-large]
"""
import gc
import sys

from hpcbert import cuda_allocator_default

cuda_allocator_default()  # CUDA's allocator as hpcbert train runs it: set, as the CLI sets it, before torch is imported

import torch  # noqa: E402

from hpcbert import meters, objectives, plan, policies  # noqa: E402
from hpcbert.config import RunConfig  # noqa: E402

dev = torch.device("cuda", 0)
tasks = (sys.argv[1] if len(sys.argv) > 1 else "synthetic,mlm").split(",")
models = (sys.argv[2] if len(sys.argv) > 2 else "bert-base").split(",")
for name, task in ((m, t) for m in models for t in tasks):
    cfg = RunConfig(task=task, model=name, max_seq_length=512, precision="bf16")
    obj = objectives.get(cfg)
    mcfg = plan._model_config(cfg)
    for policy in ("none", "selective", "alternate", "all"):
        fake = plan.measure_activations(cfg, policy, dev, "bf16")[0]
        try:
            counted = plan.measure_workspace(cfg, policy, dev, "bf16")
        except Exception as e:  # noqa: BLE001 - printed: this script is where the count is tried on a GPU
            print(f"{name} {task} {policy}: plan.measure_workspace failed: {type(e).__name__}: {e}", flush=True)
            counted = float("nan")
        model = obj.build_model(mcfg).to(dev).train()
        policies.norm_precision(model, cfg.norm_precision)
        policies.apply_grad_ckpt(model, policy)

        def loss_of(b):
            batch, norm = obj.example_batch(b, cfg.max_seq_length, mcfg.vocab_size)
            batch = batch.to(dev)
            with policies.autocast("bf16", dev):
                return obj.loss(model, obj.forward(model, batch), batch, norm)

        real = meters.activation_bytes_per_sequence(model, loss_of, dev)
        peaks = {}
        for b in (8, 16):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            loss = loss_of(b)
            after_fwd = torch.cuda.memory_allocated(dev) - base
            loss.backward()
            torch.cuda.synchronize()
            peaks[b] = (after_fwd, torch.cuda.max_memory_allocated(dev) - base)
            model.zero_grad(set_to_none=True)
            del loss
        fwd = (peaks[16][0] - peaks[8][0]) / 8
        pk = (peaks[16][1] - peaks[8][1]) / 8
        print(f"{name} {task} {policy}: MiB/seq fake {fake / 2**20:.1f} real-hooks {real / 2**20:.1f} alive-after-forward "
              f"{fwd / 2**20:.1f} peak-fwd+bwd {pk / 2**20:.1f} workspace real {(pk - fwd) / 2**20:.1f} "
              f"counted {counted / 2**20:.1f}", flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
print("allocated at end", torch.cuda.memory_allocated(dev))

"""Alpha-beta model of ring all-reduce projecting data-parallel efficiency to 8..512 GPUs.

Model (Thakur et al.; Patarasuk & Yuan): a ring all-reduce of S bytes over N
participants on links of bandwidth B and per-message latency a takes

    T_ring(N, S) = 2 (N - 1) / N * S / B + 2 (N - 1) * a.

Flat ring over all N GPUs: the ring crosses every node boundary, so each link
on it, the inter-node one included, carries 2 (N - 1) / N * S; B is the
slower of NVLink and the node's network bandwidth, and a is the inter-node
latency (the slowest hop paces every step).
Hierarchical (g GPUs per node, n = N / g nodes): ring reduce-scatter inside
the node, g rings of S / g bytes across the nodes sharing the node's network
bandwidth, ring all-gather inside the node:

    T_hier = 2 (g - 1) / g * S / B_nvlink + 2 (g - 1) * a_nvlink
           + 2 (n - 1) / n * S / B_net + 2 (n - 1) * a_net.

Step time, with T_c the measured or assumed compute time of one step
(forward + backward + update), split forward : backward = 1 : 2:
  no overlap:  T = T_c + T_comm
  overlap:     T = T_fwd + max(T_bwd, T_comm) + T_last, where T_last is the
               all-reduce of the last pack (--pack_mb), which can only start
               when the backward pass ends (an optimistic bound: gradients
               become ready uniformly through the backward pass).
Efficiency = T_c / T (weak scaling: the per-GPU batch is fixed).

ASSUMPTIONS (all overridable by flags; they are not measurements of tfdp):
* Gradient bytes = trainable parameters x --grad_bytes (4: float32
  all-reduce; 2 for float16/bfloat16 gradients). Parameters are counted from
  the real Keras models (models registry or keras.applications) unless
  --nobuild, which uses the published counts (ResNet-50 25.6M, ResNet-101
  44.7M, BERT-base 110M).
* Step compute times per GPU (from NVIDIA DeepLearningExamples-class
  published throughputs, rounded; mixed precision):
    ResNet-50, 256 images/GPU: V100 ~1,250 img/s -> 0.205 s;
                               A100 ~2,600 img/s -> 0.098 s.
    BERT-base pretraining, seq 128, 64 sequences/GPU: V100 ~650 seq/s ->
      0.098 s; A100 ~2,000 seq/s -> 0.032 s (a third of BERT-large's cost).
* Links: NVLink all-reduce bus bandwidth 130 GB/s (V100 DGX-1 class) and
  230 GB/s (A100 NVSwitch class), latency 5 us per hop; between nodes 100 or
  400 Gb/s per node at 90% efficiency, latency 10 us per hop (RDMA); 8 GPUs
  per node.
* Reference checks reproduce the published setups with the same model:
  Goyal et al. 2017 (ResNet-50, P100, 32 img/GPU, ~0.13 s/step, 50 Gb/s
  Ethernet, overlap): ~90% from 8 to 256 GPUs; Horovod (Sergeev & Del Balso
  2018; ResNet-101, P100, 64 img/GPU, ~0.45 s/step, 25 Gb/s RoCE): ~90% at
  128 GPUs.
"""

import json
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_bool("build", True, "Count parameters by building the Keras models "
                  "(else use the published counts).")
flags.DEFINE_bool("quick", False, "Same as --nobuild (CI).")
flags.DEFINE_bool("smoke", False, "Same as --nobuild (tests).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_list("gpus", ["8", "16", "32", "64", "128", "256", "512"], "GPU counts.")
flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node.")
flags.DEFINE_float("grad_bytes", 4, "Bytes per gradient element on the wire.")
flags.DEFINE_float("pack_mb", 25.0, "Size of the last gradient pack (overlap tail).")
flags.DEFINE_float("net_efficiency", 0.9, "Achieved fraction of the nominal network bandwidth.")
flags.DEFINE_float("nvlink_latency_us", 5.0, "NVLink per-hop latency.")
flags.DEFINE_float("net_latency_us", 10.0, "Inter-node per-hop latency.")
flags.DEFINE_float("step_time_s", None, "A measured compute step time to project too "
                   "(with --grad_mb); e.g. from bench_train.")
flags.DEFINE_float("grad_mb", None, "Gradient MB of the --step_time_s model.")
flags.DEFINE_string("bench_train_json", None, "bench_train --out JSON: its tfdp "
                    "throughput and model state give a measured scenario.")

GB = 1e9

# Published counts (used with --nobuild and as a check on the built models).
PUBLISHED_PARAMS = {"resnet50": 25.6e6, "resnet101": 44.7e6, "bert_base": 110e6}

# name -> (step seconds, NVLink bus GB/s); see the module docstring.
HARDWARE = {
    "V100": {"resnet50": 0.205, "bert_base": 0.098, "nvlink_GBps": 130.0},
    "A100": {"resnet50": 0.098, "bert_base": 0.032, "nvlink_GBps": 230.0},
}
NETWORKS_GBITPS = (100.0, 400.0)

REFERENCES = [
    {"name": "Goyal et al. 2017 (ResNet-50, P100, 50 Gb/s Ethernet)",
     "model": "resnet50", "step_s": 0.13, "nvlink_GBps": 80.0, "net_gbit": 50.0,
     "gpus": 256, "published": 0.90},
    {"name": "Horovod 2018 (ResNet-101, P100, 25 Gb/s RoCE)",
     "model": "resnet101", "step_s": 0.45, "nvlink_GBps": 80.0, "net_gbit": 25.0,
     "gpus": 128, "published": 0.90},
]


def count_params():
  """Trainable parameters of the real Keras models; published counts where a build fails."""
  counts, source = {}, {}
  if not (FLAGS.build and not FLAGS.quick and not FLAGS.smoke):
    return dict(PUBLISHED_PARAMS), {k: "published" for k in PUBLISHED_PARAMS}
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import keras  # pylint: disable=g-import-not-at-top
  bench_common.ensure_repo_on_path()

  def trainable(model):
    return sum(int(v.numpy().size) for v in model.trainable_weights)

  for name, app_name in (("resnet50", "ResNet50"), ("resnet101", "ResNet101")):
    model = getattr(keras.applications, app_name)(weights=None)
    counts[name], source[name] = trainable(model), f"keras.applications.{app_name}"
    keras.backend.clear_session()
  try:
    from models import bert  # pylint: disable=g-import-not-at-top
    model = bert.build(bert_config="base", seq_len=128)
    counts["bert_base"], source["bert_base"] = trainable(model), "models/bert.py (base)"
  except (ImportError, KeyError, AttributeError) as e:
    counts["bert_base"], source["bert_base"] = PUBLISHED_PARAMS["bert_base"], f"published ({e})"
  return counts, source


def t_ring(n, nbytes, bw_bytes, latency_s):
  if n <= 1:
    return 0.0
  return 2 * (n - 1) / n * nbytes / bw_bytes + 2 * (n - 1) * latency_s


def t_comm(algo, n_gpus, nbytes, nvlink_bytes, net_bytes):
  g = min(FLAGS.gpus_per_node, n_gpus)
  nodes = max(1, n_gpus // g)
  a_nv, a_net = FLAGS.nvlink_latency_us * 1e-6, FLAGS.net_latency_us * 1e-6
  if nodes == 1:
    return t_ring(g, nbytes, nvlink_bytes, a_nv)
  if algo == "flat":
    return t_ring(n_gpus, nbytes, min(nvlink_bytes, net_bytes), a_net)
  # Reduce-scatter + all-gather inside the node cost one intra-node ring;
  # the g inter-node rings of S / g bytes share the node's network link.
  return t_ring(g, nbytes, nvlink_bytes, a_nv) + t_ring(nodes, nbytes, net_bytes, a_net)


def efficiency(step_s, comm_s, last_s, overlap):
  if not overlap:
    return step_s / (step_s + comm_s)
  fwd, bwd = step_s / 3, 2 * step_s / 3
  return step_s / (fwd + max(bwd, comm_s) + last_s)


def project(model, step_s, grad_bytes, nvlink_gbps, net_gbit, algo, overlap, gpus):
  nvlink = nvlink_gbps * GB
  net = net_gbit / 8 * GB * FLAGS.net_efficiency
  out = {}
  for n in gpus:
    comm = t_comm(algo, n, grad_bytes, nvlink, net)
    last = t_comm(algo, n, min(grad_bytes, FLAGS.pack_mb * 1e6), nvlink, net)
    out[n] = {"efficiency": efficiency(step_s, comm, last, overlap), "comm_s": comm}
  return out


def main(argv):
  del argv
  gpus = [int(x) for x in FLAGS.gpus]
  params, source = count_params()
  rows = []
  for hw, spec in HARDWARE.items():
    for model in ("resnet50", "bert_base"):
      grad = params[model] * FLAGS.grad_bytes
      for net in NETWORKS_GBITPS:
        for algo in ("flat", "hierarchical"):
          for overlap in (False, True):
            proj = project(model, spec[model], grad, spec["nvlink_GBps"], net, algo,
                           overlap, gpus)
            rows.append({"model": model, "gpu": hw, "step_s": spec[model],
                         "grad_MB": grad / 1e6, "net_Gbps": net, "algo": algo,
                         "overlap": overlap,
                         **{f"eff_{n}": proj[n]["efficiency"] for n in gpus},
                         **{f"comm_ms_{n}": proj[n]["comm_s"] * 1e3 for n in gpus}})
  measured = None
  step, grad_mb = FLAGS.step_time_s, FLAGS.grad_mb
  if FLAGS.bench_train_json:
    with open(FLAGS.bench_train_json) as f:
      bt = json.load(f)
    raw = bt["throughput"]["raw"]
    rate = raw["variants"]["tfdp"]["median_examples_per_s"]
    step = step or bt["throughput"]["settings"]["global_batch_size"] / rate
    grad_mb = grad_mb or raw["state_bytes"] / 1e6
  if step and grad_mb:
    measured = []
    for net in NETWORKS_GBITPS:
      for overlap in (False, True):
        proj = project("measured", step, grad_mb * 1e6, 130.0, net, "hierarchical",
                       overlap, gpus)
        measured.append({"model": "measured", "step_s": step, "grad_MB": grad_mb,
                         "net_Gbps": net, "algo": "hierarchical", "overlap": overlap,
                         **{f"eff_{n}": proj[n]["efficiency"] for n in gpus}})
  refs = []
  for ref in REFERENCES:
    grad = params[ref["model"]] * FLAGS.grad_bytes
    r = {"reference": ref["name"], "gpus": ref["gpus"], "published": ref["published"]}
    for algo in ("flat", "hierarchical"):
      for overlap in (False, True):
        proj = project(ref["model"], ref["step_s"], grad, ref["nvlink_GBps"],
                       ref["net_gbit"], algo, overlap, [ref["gpus"]])
        r[f"{algo}{'_overlap' if overlap else ''}"] = proj[ref["gpus"]]["efficiency"]
    refs.append(r)

  print("Projected data-parallel efficiency (weak scaling), alpha-beta ring model.")
  print("ASSUMED step times and links (see the docstring); parameters: "
        + ", ".join(f"{k} {v / 1e6:.1f}M ({source[k]})" for k, v in params.items()))
  cols = [("model", "model", None), ("gpu", "GPU", None), ("step_s", "step s", "{:.3f}"),
          ("grad_MB", "grad MB", "{:.0f}"), ("net_Gbps", "net Gb/s", "{:.0f}"),
          ("algo", "all-reduce", None), ("overlap", "overlap", None)]
  cols += [(f"eff_{n}", str(n), "{:.2f}") for n in gpus]
  print(bench_common.table(rows, cols))
  if measured:
    print("\nMeasured step time on this machine, projected onto V100-class links:")
    print(bench_common.table(measured, [c for c in cols if c[0] != "gpu"]))
  print("\nReferences (published vs this model with their setups):")
  print(bench_common.table(refs, [
      ("reference", "reference", None), ("gpus", "GPUs", "{}"),
      ("published", "published", "{:.2f}"), ("flat", "flat", "{:.2f}"),
      ("flat_overlap", "flat+overlap", "{:.2f}"), ("hierarchical", "hier", "{:.2f}"),
      ("hierarchical_overlap", "hier+overlap", "{:.2f}")]))
  bench_common.write_json(FLAGS.out, {
      "params": params, "param_source": source, "gpus": gpus, "rows": rows,
      "measured": measured, "references": refs,
      "assumptions": {"hardware": HARDWARE, "networks_Gbps": NETWORKS_GBITPS,
                      "gpus_per_node": FLAGS.gpus_per_node, "grad_bytes": FLAGS.grad_bytes,
                      "pack_mb": FLAGS.pack_mb, "net_efficiency": FLAGS.net_efficiency,
                      "nvlink_latency_us": FLAGS.nvlink_latency_us,
                      "net_latency_us": FLAGS.net_latency_us,
                      "fwd_bwd_split": "1:2", "doc": __doc__}})


if __name__ == "__main__":
  app.run(main)

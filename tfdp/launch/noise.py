"""Known TF/gRPC log lines that say nothing when a job succeeds, and the switch that shows them anyway."""

import os
import re
from typing import Mapping, NamedTuple, Optional

# Set to 1 (or pass --verbose_workers) to see every worker line as it comes.
ENV_SHOW_TF_LOGS = "TFDP_SHOW_TF_LOGS"

# absl's prefix, as TF's C++ writes it (I0000 00:00:1796133538.349871   25316 f.cc:31])
# and as Python's absl writes it (W1201 14:02:15.351870 140258832587648 f.py:234]).
ABSL = r"{levels}\d{{4}} [\d:.]+ +\d+ "


class Noise(NamedTuple):
  """A known kind of TF/gRPC log line that says nothing when the job succeeds.

  `line` must match the whole line; `continued` matches the lines that
  continue such a record (TF writes some records over several lines), held
  only right after one.
  """
  name: str
  line: "re.Pattern[str]"
  continued: Optional["re.Pattern[str]"] = None


def _noise(name, line, continued=None):
  return Noise(name, re.compile(line), re.compile(continued) if continued else None)


# Every worker writes these on a healthy run; they are counted when one fails.
# Each matches one exact message, except TF's C++ INFO lines, which never
# report an error.
NOISE = (
    # Printed by every TF process before TF_CPP_MIN_LOG_LEVEL is read.
    _noise("absl-preinit", r"WARNING: All log messages before absl::InitializeLog\(\) "
                           r"is called are written to STDERR"),
    # A machine without a CUDA driver: TF says so, then cuInit fails with
    # CUDA_ERROR_SHARED_OBJECT_INIT_FAILED (303, no libcuda). A driver that is
    # there but broken fails with another code, which is shown.
    _noise("no-cuda-driver", ABSL.format(levels="I") + r"cudart_stub\.cc:\d+\] Could not "
           r"find cuda drivers on your machine, GPU will not be used\."),
    _noise("cuinit-no-driver", ABSL.format(levels="E") + r"cuda_platform\.cc:\d+\] failed "
           r"call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR \(303\)"),
    # TF's C++ INFO lines (TF_CPP_MIN_LOG_LEVEL=0): CPU features, the gRPC
    # server, the coordination service connecting its tasks.
    _noise("tf-cpp-info", ABSL.format(levels="I") + r"[\w.-]+\.(?:cc|h):\d+\] .*",
           continued=r"To enable the following instructions: [\w ,.]+ in other operations, "
                     r"rebuild TensorFlow with the appropriate compiler flags\."
                     r"|/job:\w+/replica:\d+/task:\d+"),
    # tf.data about Python generators, on every Keras fit of NumPy arrays.
    _noise("dataset-not-optimized", ABSL.format(levels="W") + r"dataset\.cc:\d+\] Input of "
           r"GeneratorDatasetOp::Dataset will not be optimized because the dataset does not "
           r"implement the AsGraphDefInternal\(\) method needed to apply optimizations\."),
    # A peer that is gone at the end of a finished run: a worker whose chief
    # (the coordination service) has exited, or the chief after a worker
    # stopped sending heartbeats. Mid-run the same lines come with a failure.
    _noise("start-abort-unavailable", ABSL.format(levels="E") + r"base_collective_executor"
           r"\.cc:\d+\] BaseCollectiveExecutor::StartAbort UNAVAILABLE: (?:Failed to send RPC "
           r"to coordination service\.|Error reported from /job:\S+: The following tasks are "
           r"unhealthy \(stopped sending heartbeats\):).*",
           continued=r"/job:\w+/replica:\d+/task:\d+"
                     r"|The tasks have crashed\. Check the task logs for an earlier error.*"
                     r"|Additional GRPC error information from remote target /job:\S+ while "
                     r"calling /tensorflow\.CoordinationService/\w+:"
                     r"|:UNKNOWN:Error received from peer .*"),
    # tf.train.Checkpoint, when a checkpoint holds more than what restored it
    # (e.g. optimizer slots when only weights are restored). What a restore
    # left unset ("An attribute in the restored object could not be found")
    # is not in the list.
    _noise("checkpoint-unused-values",
           r"(?:" + ABSL.format(levels="W") + r"checkpoint\.py:\d+\] |WARNING:tensorflow:)"
           r"(?:Detecting that an object or model or tf\.train\.Checkpoint is being deleted "
           r"with unrestored values\..*"
           r"|Value in checkpoint could not be found in the restored object: \S+)"),
)


def noise_kind(previous: Optional[Noise], text: str) -> Optional[Noise]:
  """The Noise that line `text` is, given that of the line before it (None: not noise)."""
  if previous is not None and previous.continued and previous.continued.fullmatch(text):
    return previous
  return next((noise for noise in NOISE if noise.line.fullmatch(text)), None)


def show_tf_logs(env: Optional[Mapping[str, str]] = None) -> bool:
  """True when ENV_SHOW_TF_LOGS asks for every worker line (anything but unset, '', 0, false, no)."""
  value = (os.environ if env is None else env).get(ENV_SHOW_TF_LOGS, "")
  return value.strip().lower() not in ("", "0", "false", "no")

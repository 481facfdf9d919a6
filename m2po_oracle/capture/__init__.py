"""Recording what a training run fed its M2PO loss, for ``m2po-oracle audit``.

``recorder`` is the vendorable file (it imports nothing of the package: copy it into a
framework); ``reader`` reads and checks a capture for the audit; ``watching`` wraps a framework's own M2PO function in one line (``watch``), reading each call
through ``watch_reading``.
"""

from m2po_oracle.capture.reader import Capture, RecordInfo, check_capture, load_capture
from m2po_oracle.capture.recorder import OPTIONAL_TENSOR_NAMES, SCHEMA, TENSOR_NAMES, CaptureError, GradientWatch, Recorder
from m2po_oracle.capture.watching import Watcher, watch

__all__ = [
    "OPTIONAL_TENSOR_NAMES",
    "SCHEMA",
    "TENSOR_NAMES",
    "Capture",
    "CaptureError",
    "GradientWatch",
    "RecordInfo",
    "Recorder",
    "Watcher",
    "check_capture",
    "load_capture",
    "watch",
]

"""m2po-oracle: reference oracle and equivalence suite for M2PO.

The public API, the paths a user imports (everything else is the toolkit's inside and may
move between releases):

- ``m2po_oracle.oracle``: Algorithm 1 transcribed in float64 NumPy, one small function per
  step, without torch (``m2po``, ``evaluate_with_mask``, ...), and its records
  (``oracle.batch.Batch``, ``oracle.record.M2POResult``);
- ``m2po_oracle.core``: the production torch implementation (``m2po_loss`` and its parts);
- ``m2po_oracle.strategies``: the Hypothesis strategies that draw M2PO batches;
- ``m2po_oracle.capture``: recording a training run for ``m2po-oracle audit`` (``Recorder``,
  ``watch``, ``load_capture``);
- ``m2po_oracle.integrations.trl`` and ``m2po_oracle.integrations.swift``: M2PO inside TRL's
  and ms-swift's GRPO trainers;
- the ``m2po-oracle`` command (``m2po_oracle.cli.main:main``, also ``python -m m2po_oracle``)
  and the pytest plugin (``m2po_oracle.cli.pytest_plugin``, registered as ``m2po_oracle``).

Importing the package imports none of them: the oracle stays usable without torch.
"""

__version__ = "0.1.0"

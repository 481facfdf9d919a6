"""m2po-oracle: reference oracle and equivalence suite for M2PO.

``m2po_oracle.oracle`` is the NumPy transcription of Algorithm 1 (no torch);
``m2po_oracle.core`` is the production torch implementation.
"""

__version__ = "0.1.0"

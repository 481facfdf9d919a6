"""The file ``swift rlhf --external_plugins`` loads: M2PO in ms-swift's GRPO trainer.

    swift rlhf --rlhf_type grpo --loss_type dapo ... --external_plugins "$(python -m m2po_oracle.integrations.swift)"

Options are environment variables (M2PO_TAU, M2PO_CAPTURE, M2PO_CAPTURE_EVERY); see
:mod:`m2po_oracle.integrations.swift`. ms-swift puts this file's folder first on
``sys.path``, so the folder holds nothing that could shadow another module.
"""

from m2po_oracle.integrations.swift import install

install()

"""M2PO inside production trainers (the top floor: nothing else in the package imports this room).

* :mod:`m2po_oracle.integrations.trl`: ``M2POGRPOTrainer``, TRL's ``GRPOTrainer`` with the
  M2PO loss selected once per optimizer batch (``pip install -c constraints.txt -e '.[trl]'``);
* :mod:`m2po_oracle.integrations.trl_demo`: a short real TRL training on a random-weight
  Llama, recorded for ``m2po-oracle audit``;
* :mod:`m2po_oracle.integrations.trl_step`: the same trainer behind the trainer contract,
  for ``m2po-oracle compare --impl trainer:trl``.
* :mod:`m2po_oracle.integrations.swift`: ``M2POSwiftGRPOTrainer``, ms-swift 4.6's GRPO trainer
  with the same M2PO, loaded by ``swift rlhf --external_plugins`` from ``swift_plugin/`` (its own
  environment: ``constraints-swift.txt``);
* :mod:`m2po_oracle.integrations.swift_demo`: a short real ``swift rlhf`` training on a
  random-weight Llama, recorded for ``m2po-oracle audit``;
* :mod:`m2po_oracle.integrations.swift_step`: the same trainer behind the trainer contract,
  for ``m2po-oracle compare --impl trainer:swift``;
* :mod:`m2po_oracle.integrations.hf_window` and :mod:`m2po_oracle.integrations.hf_step`: what
  the TRL and ms-swift integrations, and their steps, share.
"""

"""A whole GRPO + M2PO training step under test: the step itself (``grpo``), the cases that
drive it, its checks, planted controls, fail-closed probes, diagnosis and runner."""

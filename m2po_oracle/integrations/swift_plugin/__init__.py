"""Holds only the ``--external_plugins`` file for ms-swift (see m2po_swift_plugin.py)."""

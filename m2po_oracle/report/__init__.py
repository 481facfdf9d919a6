"""Reports: the declarations of the JSON records (:mod:`.schema`: every key path of the compare
report ``m2po-oracle/compare/1``, the audit, a capture's manifest and the benches) and the HTML
pages rendered from the compare report and the audit alone."""

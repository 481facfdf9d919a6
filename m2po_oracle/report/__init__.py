"""Reports: the JSON record (schema ``m2po-oracle/compare/1``) and the HTML page rendered
from it alone."""

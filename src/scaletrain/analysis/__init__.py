"""Looking at runs after the fact: the HTML report (and, later, sweeps and the cost model)."""

"""Severity: what each finding costs, as the what-if saving of fixing its cause, priced in order
(the findings above it fixed first), and the candidates that save too little dismissed. The
detectors (the modules beside this package) find candidates; this package prices them."""

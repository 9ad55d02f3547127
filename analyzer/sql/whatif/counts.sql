-- whatif/counts: operations per (rank, step) and each step's first arrival (its zero)
select rank, step, count(*) as n, min(t0) as t0, max(t1) as t1
from whatif_ops
group by rank, step

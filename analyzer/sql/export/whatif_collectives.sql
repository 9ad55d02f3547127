-- whatif_collectives: the finished collective rows of the steps, with their arrival (t0) as
-- the what-if reads it (view whatif_ops, analyzer/sql/whatif/ops.sql).
select rank, step, label as op, grp, seq, peer, t0, greatest(t1, t0) as t1
from whatif_ops
where cls > 0
order by rank, step, t0, seq

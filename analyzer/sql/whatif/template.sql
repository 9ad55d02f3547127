-- whatif/template: every operation of one step, in each rank's order ($step, $zero: its start)
-- (at one start time, in the order of whatif_ops.tie)
select
    rank,
    cls,
    label,
    grp,
    seq,
    peer,
    nbytes,
    (t0 - $zero) / 1e9 as t0,
    (greatest(t1, t0) - $zero) / 1e9 as t1
from whatif_ops
where step = $step
order by rank, t0, tie, t1, cls, seq

-- whatif/template: every operation of one step, in each rank's order ($step, $zero: its start)
-- (ties in start: the longer first, so that a span that starts with a collective holds it)
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
order by rank, t0, t1 desc, cls, seq

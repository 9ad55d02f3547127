-- whatif/template: every operation of one step, in each rank's order ($step, $zero: its start)
-- (at one start: sends and receives first, posted beside the span that starts with them; then
-- spans; then collectives, which a span that starts with them holds, as a sequence-parallel
-- all_gather opening a forward)
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
order by rank, t0, (case cls when 0 then 1 when 1 then 2 else 0 end), t1, cls, seq

-- whatif/batch: the operations of a batch of ranks (the views spans and collectives over their
-- files), sorted as whatif/template.sql and whatif/times.sql number them: by rank and step, then
-- the rank's order in its step; only steps $lo..$hi. The template's own columns (label, group,
-- seq, peer, nbytes: tpl_*) only in step $tstep (every step when $tstep < 0); the sort keys are
-- the source columns (not the tpl_ ones, null in other steps).
select
    rank,
    step,
    cls,
    t0,
    t1,
    case when $tstep < 0 or step = $tstep then label end as tpl_label,
    case when $tstep < 0 or step = $tstep then grp end as tpl_grp,
    case when $tstep < 0 or step = $tstep then seq end as tpl_seq,
    case when $tstep < 0 or step = $tstep then peer end as tpl_peer,
    case when $tstep < 0 or step = $tstep then nbytes end as tpl_nbytes
from whatif_ops
where step between $lo and $hi
order by rank, step, t0, tie, t1, cls, seq

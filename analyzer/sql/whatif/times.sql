-- whatif/times: every operation's arrival and end (seconds after its step's zero, float32) at
-- its position in its rank's step, in the order of whatif/template.sql; only the steps in
-- whatif_steps (step, idx, zero_ns), which all have the template's count of operations
select
    o.rank,
    s.idx::smallint as idx,
    (row_number() over (partition by o.rank, o.step order by o.t0, o.tie, o.t1, o.cls, o.seq) - 1)::integer
        as pos,
    ((o.t0 - s.zero_ns) / 1e9)::float as t0,
    ((greatest(o.t1, o.t0) - s.zero_ns) / 1e9)::float as t1
from whatif_ops as o
inner join whatif_steps as s on o.step = s.step

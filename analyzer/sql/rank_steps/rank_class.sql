-- each rank's peer class (the view dash_rank_class, over dash_topology: analyzer/rank_steps.py),
-- the one definition rank_step_peer.sql and rank_step_score.sql compare ranks within: the
-- pipeline stage, the context shard (-1 where no other rank of the stage holds it, so all
-- ranks of a data-parallel-only job) and the hardware class
-- columns: rank, pp, shard, hw_class
select
    rank,
    pp,
    case when count(*) over (partition by pp, cp) >= 2 then cp else -1 end as shard,
    hw_class
from dash_topology

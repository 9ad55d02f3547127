-- the cached topology (see topology.sql)
-- columns: rank, host, dp, pp, tp, cp, hw_class
with
final as (
    select * from dash_topology order by rank
)
select * from final

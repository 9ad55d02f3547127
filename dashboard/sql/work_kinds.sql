-- the work kinds the run has, as the dashboard names them (tokens, expert_tokens, a2a_recv)
-- columns: kind
with
final as (
    select distinct kind from dash_work
)
select * from final order by kind

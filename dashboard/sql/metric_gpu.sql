-- per rank: mean NVML readings over the time its steps $first..$last took
-- columns: rank, sm_clock_mhz, power_w, temp_c, util_gpu, samples
with
windows as (
    select rank, min(t0_ns) as t0_ns, max(t1_ns) as t1_ns
    from dash_rank_step
    where step between $first and $last
    group by rank
),
samples as (
    select g.rank, g.sm_clock_mhz, g.power_w, g.temp_c, g.util_gpu
    from dash_gpu as g
    inner join windows as w
        on g.rank = w.rank and g.ts_ns between w.t0_ns and w.t1_ns
),
final as (
    select
        rank,
        avg(sm_clock_mhz) as sm_clock_mhz,
        avg(power_w) as power_w,
        avg(temp_c) as temp_c,
        avg(util_gpu) as util_gpu,
        count(*) as samples
    from samples
    group by rank
)
select * from final

-- gpu_ranks: per rank, its GPU samples summarized (NVML; absent on CPU runs).
-- columns: rank, samples, sm_clock_mhz, temp_c, power_w, throttle_frac, max_temp_c
--   throttle_frac = share of samples with any bit of $mask set in throttle_reasons
with

final as (
    select
        rank,
        count(*) as samples,
        median(sm_clock_mhz) as sm_clock_mhz,
        median(temp_c) as temp_c,
        median(power_w) as power_w,
        avg(case when (coalesce(throttle_reasons, 0) & $mask) <> 0 then 1.0 else 0.0 end)
            as throttle_frac,
        max(temp_c) as max_temp_c
    from gpu
    group by rank
)

select * from final

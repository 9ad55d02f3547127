-- gpu_ranks: per rank, its GPU samples summarized (NVML; absent on CPU runs).
-- columns: rank, samples, sm_clock_mhz, max_clock_mhz, temp_c, power_w, throttle_frac,
--   max_temp_c, power_cap, hw_slowdown, sw_thermal, hw_thermal, power_brake
--   throttle_frac = share of samples with any bit of $mask set in throttle_reasons; the five
--   reason columns: share of samples with that NVML clock-event reason (0x4, 0x8, 0x20, 0x40,
--   0x80)
with

reasons as (
    select
        *,
        coalesce(throttle_reasons, 0) as bits
    from gpu
),

final as (
    select
        rank,
        count(*) as samples,
        median(sm_clock_mhz) as sm_clock_mhz,
        max(sm_clock_mhz) as max_clock_mhz,
        median(temp_c) as temp_c,
        median(power_w) as power_w,
        avg(case when (bits & $mask) <> 0 then 1.0 else 0.0 end) as throttle_frac,
        max(temp_c) as max_temp_c,
        avg(case when (bits & 4) <> 0 then 1.0 else 0.0 end) as power_cap,
        avg(case when (bits & 8) <> 0 then 1.0 else 0.0 end) as hw_slowdown,
        avg(case when (bits & 32) <> 0 then 1.0 else 0.0 end) as sw_thermal,
        avg(case when (bits & 64) <> 0 then 1.0 else 0.0 end) as hw_thermal,
        avg(case when (bits & 128) <> 0 then 1.0 else 0.0 end) as power_brake
    from reasons
    group by rank
)

select * from final

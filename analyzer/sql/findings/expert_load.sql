-- expert_load: per expert, the token assignments it received over [$lo, $hi] and the ranks
-- that hold it (the ranks that record its expert_tokens rows, docs/spec.md §2).
-- columns: expert, assignments, holders (sorted list of ranks)
select
    key as expert,
    sum(value)::double as assignments,
    list(distinct rank order by rank) as holders
from work
where kind = 'expert_tokens' and step between $lo and $hi and key >= 0
group by key
order by key

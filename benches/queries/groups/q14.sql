-- GROUP BY a skewed key (most rows in a few groups, 10^5 groups in all).
SELECT kz, count(*) AS n, sum(v) AS s
FROM facts
GROUP BY kz
ORDER BY n DESC, kz
LIMIT 10

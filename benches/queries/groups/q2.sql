-- GROUP BY an integer key of 10^6 values (10 rows a group).
SELECT k1m, count(*) AS n, sum(q) AS s
FROM facts
GROUP BY k1m
ORDER BY s DESC, k1m
LIMIT 10

-- GROUP BY two small keys (shrinks to 100 groups).
SELECT k10, s10, count(*) AS n, sum(q) AS s, min(v) AS lo, max(v) AS hi, avg(v) AS a
FROM facts
GROUP BY k10, s10
ORDER BY k10, s10

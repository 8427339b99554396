-- A selective filter and a small GROUP BY.
SELECT k10, count(*) AS n, sum(v) AS s
FROM facts
WHERE k1m < 2000 AND q > 50
GROUP BY k10
ORDER BY k10

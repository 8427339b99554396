-- COUNT(DISTINCT) of a 10^5-value key per small group.
SELECT k10, count(DISTINCT k100k) AS d
FROM facts
GROUP BY k10
ORDER BY k10
